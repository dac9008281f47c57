"""Prefill cost: the tokens worker w would still have to prefill before this request's first token.

    P(w) = max(prompt_tokens - overlap_tokens(w), 0) + prefill_tokens_queued(w) + inflight_prefill_tokens(w)
    cost(w) = P(w) / max(max_c P(c), 1)          over the candidates c  → in [0, 1]

overlap_tokens(w) = min(matched_blocks(w) · block_size, prompt_tokens) comes from the prefix index;
prefill_tokens_queued is the worker's last load report; inflight_prefill_tokens is this router's own
assignments since that report. Used alone this is "KV overlap" routing; the default `cost` scorer combines
it with decode load on a shared scale.
"""

from __future__ import annotations

from collections.abc import Sequence

from kvmesh.routing.plugin import SCORERS, register
from kvmesh.routing.types import RoutingQuery, WorkerView


def prefill_tokens(req: RoutingQuery, w: WorkerView) -> int:
    """P(w) = max(prompt - overlap(w), 0) + prefill_tokens_queued(w) + inflight_prefill_tokens(w)."""
    m = req.matches.get(w.id, 0)
    new = req.prompt_tokens - m * req.block_size if m else req.prompt_tokens
    if new < 0:
        new = 0
    return new + w.prefill_tokens_queued + w.inflight_prefill_tokens


@register(SCORERS, "prefill-cost")
class PrefillCostScorer:
    """cost(w) = P(w) / max_c P(c)"""

    name = "prefill-cost"

    def score(
        self, req: RoutingQuery, candidates: Sequence[WorkerView], all_workers: Sequence[WorkerView]
    ) -> list[float]:
        raw = [prefill_tokens(req, w) for w in candidates]
        scale = max(max(raw, default=0), 1)
        return [r / scale for r in raw]
