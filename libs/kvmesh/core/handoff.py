"""Prefill/decode disaggregation's domain types: a worker's role, and the KV a prefill worker hands to a
decode worker (docs/disaggregation.md). Pure.

A disaggregated request runs in two halves: the prefill half (`EngineRequest.hand_off_ms`) computes the
prompt's KV on a prefill worker, which holds it for that long and ends with a `KvHandoff`; the decode half
(`EngineRequest.handoff`) loads it on a decode worker and generates. The handoff travels one of two ways:
the engine's own transfer (vLLM's NixlConnector: `engine_params_json` is vLLM's `kv_transfer_params`), or a
kv-sync pull from the prefill worker's tier (`pull`, the one pull type, `kvmesh.core.pull`). Either is best
effort: a handoff that fails or is void by the time it is used ends in computing the prompt, same output.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass

from kvmesh.core.pull import KvPull


class WorkerRole(enum.StrEnum):
    """A worker's part in disaggregated serving. `both` prefills and decodes (aggregated serving, and decode
    halves); `prefill` runs prefill halves only; `decode` runs decode halves and aggregated requests."""

    BOTH = "both"
    PREFILL = "prefill"
    DECODE = "decode"

    @property
    def prefills(self) -> bool:
        """Whether it runs prefill halves (a `both` worker may: a disaggregated request's prefill half)."""
        return self is not WorkerRole.DECODE

    @property
    def decodes(self) -> bool:
        """Whether it runs decode halves and aggregated requests."""
        return self is not WorkerRole.PREFILL


@dataclass(frozen=True, slots=True)
class KvHandoff:
    """The KV of a prompt's `num_blocks` leading blocks, computed by `source_worker_id` and held there until
    `held_until_unix_ms`: reachable by `engine_params_json` (the engine's own transfer, a JSON object) or by
    `pull` (kv-sync from the prefill worker's tier). `cached_tokens`: the prompt tokens the prefill worker
    found cached (the request's `cached_tokens`, not the handed-over ones)."""

    num_blocks: int = 0
    held_until_unix_ms: int = 0
    source_worker_id: str = ""
    engine_params_json: str = ""
    pull: KvPull | None = None
    cached_tokens: int = 0

    def void(self, now_unix_ms: float) -> bool:
        """Whether the prefill worker no longer holds the blocks (its hold ended)."""
        return bool(self.held_until_unix_ms) and now_unix_ms >= self.held_until_unix_ms
