"""Decode capability: how well worker w can take more decode work.

    q(w)   = clip(1 - waiting(w) / max_queue(w), 0, 1)        (1 when max_queue is unknown, 0)
    l(w)   = clip(1 - decode_latency(w) / base_latency_ms, 0, 1)   decode_latency = p50 (or p95)
    h(w)   = max(prefix_hit_rate(w), hit_rate_floor)
    capability(w) = q(w) · l(w) · h(w)      ∈ [0, 1], higher is better
    cost(w) = 1 - capability(w)

`hit_rate_floor` (default 0) keeps a cold fleet, where every hit rate is 0, from zeroing every score.
"""

from __future__ import annotations

from collections.abc import Sequence

from kvmesh.routing.plugin import SCORERS, register
from kvmesh.routing.types import RoutingQuery, WorkerView


def _clip01(x: float) -> float:
    return 0.0 if x < 0.0 else 1.0 if x > 1.0 else x


@register(SCORERS, "decode-capability")
class DecodeCapabilityScorer:
    """cost(w) = 1 - (1 - queue/max_queue)·(1 - latency/base_latency)·kv_hit_rate"""

    name = "decode-capability"

    def __init__(self, base_latency_ms: float = 1200.0, latency: str = "p50", hit_rate_floor: float = 0.0) -> None:
        if base_latency_ms <= 0:
            raise ValueError("base_latency_ms must be > 0")
        if latency not in ("p50", "p95"):
            raise ValueError("latency must be p50 or p95")
        self.base_latency_ms = base_latency_ms
        self.use_p95 = latency == "p95"
        self.hit_rate_floor = hit_rate_floor

    def capability(self, w: WorkerView) -> float:
        q = _clip01(1.0 - w.waiting / w.max_queue) if w.max_queue > 0 else 1.0
        lat = w.decode_latency_p95_ms if self.use_p95 else w.decode_latency_p50_ms
        lf = _clip01(1.0 - lat / self.base_latency_ms)
        h = max(_clip01(w.prefix_hit_rate), self.hit_rate_floor)
        return q * lf * h

    def score(
        self, req: RoutingQuery, candidates: Sequence[WorkerView], all_workers: Sequence[WorkerView]
    ) -> list[float]:
        return [1.0 - self.capability(w) for w in candidates]
