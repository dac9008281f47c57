"""Node health: a blend of load headroom, free KV memory and version match.

    load(w)            = (running(w) + waiting(w)) / max_queue(w)   if max_queue(w) > 0
                         (running + waiting) / max_c (running + waiting)   otherwise (0 if all idle)
    normalised_load(w) = 1 - clip(load(w), 0, 1)          (headroom: 1 = idle, 0 = full)
    mem_util(w)        = kv_usage(w)
    version_match(w)   = 1 if version == "" or w.version == version else 0
    health(w) = 0.6 · normalised_load(w) + 0.3 · (1 - mem_util(w)) + 0.1 · version_match(w)
    cost(w)   = 1 - health(w)

The 0.6/0.3/0.1 weights are parameters (`load_weight`, `mem_weight`, `version_weight`).
"""

from __future__ import annotations

from collections.abc import Sequence

from kvmesh.routing.plugin import SCORERS, register
from kvmesh.routing.types import RoutingQuery, WorkerView


def _clip01(x: float) -> float:
    return 0.0 if x < 0.0 else 1.0 if x > 1.0 else x


@register(SCORERS, "node-health")
class NodeHealthScorer:
    """cost(w) = 1 - (0.6·normalised_load + 0.3·(1 - mem_util) + 0.1·version_match)"""

    name = "node-health"

    def __init__(
        self,
        version: str = "",
        load_weight: float = 0.6,
        mem_weight: float = 0.3,
        version_weight: float = 0.1,
    ) -> None:
        self.version = version
        self.wl, self.wm, self.wv = load_weight, mem_weight, version_weight

    def health(self, w: WorkerView, busiest: int) -> float:
        """health(w); `busiest` = max over candidates of running + waiting (for workers without max_queue)."""
        busy = w.running + w.waiting
        load = busy / w.max_queue if w.max_queue > 0 else (busy / busiest if busiest > 0 else 0.0)
        vm = 1.0 if (not self.version or w.version == self.version) else 0.0
        return self.wl * (1.0 - _clip01(load)) + self.wm * (1.0 - _clip01(w.kv_usage)) + self.wv * vm

    def score(
        self, req: RoutingQuery, candidates: Sequence[WorkerView], all_workers: Sequence[WorkerView]
    ) -> list[float]:
        busiest = max((w.running + w.waiting for w in candidates), default=0)
        return [1.0 - self.health(w, busiest) for w in candidates]
