"""Pricing a peer pull against recomputing (pure): the router's pull hint.

For the worker the profile chose, w, holding `matches[w]` leading blocks, and a peer p that serves its tier
(`WorkerView.kvsync_address`) holding `matches[p]` > `matches[w]`, the blocks between them could be pulled.
With n = (min(matches[p], cap) − matches[w]) · block_size tokens (cap: every block but the one holding the
prompt's last token, which the engine always computes), in seconds of the perf model:

    pull_s      = RTT + KV_tok·n / B_net + KV_tok·n / B_pcie        (`dataplane.pull_seconds`: peer → here → GPU)
    recompute_s = chunked prefill of n tokens on top of matches[w] cached blocks

A pull is chosen only when `pull_s · margin ≤ recompute_s`; of several peers, the one with the longest
match (then the least loaded). Every term is returned for the request's log.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from kvmesh.engine.sim.perf import H200_LLAMA70B_FP8, PerfModel, chunked_prefill_time
from kvmesh.routing.dataplane import pull_seconds, transfer_costs
from kvmesh.routing.types import CircuitState, RoutingQuery, WorkerView

DEFAULT_MARGIN = 2.0
OPEN = CircuitState.OPEN


@dataclass(frozen=True, slots=True)
class PullChoice:
    """Pull `blocks` leading blocks (the peer's whole usable match) from `source`, `tokens` of them new."""

    source: str
    blocks: int
    tokens: int
    pull_s: float
    recompute_s: float


def choose_pull(
    query: RoutingQuery,
    target: str,
    views: Sequence[WorkerView],
    perf: PerfModel = H200_LLAMA70B_FP8,
    margin: float = DEFAULT_MARGIN,
    chunk: int = 1024,
) -> PullChoice | None:
    """The pull to hint to `target`, or None when no peer holds more of the prompt or recomputing is cheaper."""
    bs = query.block_size
    cap = max(0, (query.prompt_tokens - 1) // bs)
    have = min(query.matches.get(target, 0), cap)
    # a draining peer still serves its tier; an unhealthy one or one whose circuit is open does not
    peers = [v for v in views if v.id != target and v.kvsync_address and v.healthy and v.circuit is not OPEN]
    best = max(peers, key=lambda v: (min(query.matches.get(v.id, 0), cap), -v.running - v.waiting), default=None)
    if best is None:
        return None
    blocks = min(query.matches.get(best.id, 0), cap)
    tokens = (blocks - have) * bs
    if tokens <= 0:
        return None
    pull_s = pull_seconds(blocks - have, transfer_costs(bs, perf))
    recompute_s = chunked_prefill_time(tokens, have * bs, chunk, perf)
    if pull_s * margin > recompute_s:
        return None
    return PullChoice(best.id, blocks, tokens, pull_s, recompute_s)
