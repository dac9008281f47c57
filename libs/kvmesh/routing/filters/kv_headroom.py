"""KV headroom filter: drop a worker whose KV use would exceed `max_usage` (default 95 %) after the request.

For worker w with `T = w.kv_blocks_total` blocks:

    new_blocks(w) = ceil((prompt_tokens - overlap_tokens(w) [+ max_tokens if include_output]) / block_size)
    usage_after(w) = (kv_usage(w) · T + inflight_kv_blocks(w) + new_blocks(w)) / T
    keep(w)  ⇔  usage_after(w) ≤ max_usage

A worker that reports no capacity (T = 0, e.g. before its first load report) is kept: the filter only
removes workers it knows to be full. If every worker is full the filter returns none, and the pipeline's
`Decision.rejected_by == "kv-headroom"` tells the caller to wait or answer RESOURCE_EXHAUSTED.
"""

from __future__ import annotations

from collections.abc import Sequence

from kvmesh.routing.plugin import FILTERS, register
from kvmesh.routing.types import RoutingQuery, WorkerView


@register(FILTERS, "kv-headroom")
class KvHeadroomFilter:
    """keep(w) ⇔ (kv_usage·T + inflight_kv_blocks + new_blocks) / T ≤ max_usage"""

    name = "kv-headroom"

    def __init__(self, max_usage: float = 0.95, include_output: bool = False) -> None:
        if not 0.0 < max_usage <= 1.0:
            raise ValueError("max_usage must be in (0, 1]")
        self.max_usage = max_usage
        self.include_output = include_output

    def filter(self, req: RoutingQuery, workers: Sequence[WorkerView]) -> Sequence[WorkerView]:
        bs = max(req.block_size, 1)
        prompt = req.prompt_tokens
        extra = req.max_tokens if self.include_output else 0
        matches = req.matches
        limit = self.max_usage
        out = []
        for w in workers:
            total = w.kv_blocks_total
            if total <= 0:
                out.append(w)
                continue
            m = matches.get(w.id, 0)
            cached = m * bs if m else 0
            new_tokens = prompt - (cached if cached < prompt else prompt) + extra
            new_blocks = -(-new_tokens // bs) if new_tokens > 0 else 0
            if w.kv_usage * total + w.inflight_kv_blocks + new_blocks <= limit * total:
                out.append(w)
        return out
