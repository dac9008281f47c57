"""A perfect-knowledge reference policy (not a contender): the worker caching the longest prefix.

    w = argmax_w matches(w), ties → fewest running + waiting requests, then lowest index

It reads the exact index of the simulated cache-manager, so on a trace whose working set fits one worker it
reuses every reusable block: its hit ratio is what the pooled-LRU reference promises (tested).
"""

from __future__ import annotations

from collections.abc import Sequence

from kvmesh.fleet.policies.base import Policy, load_of
from kvmesh.routing.types import RoutingQuery, WorkerView


class MaxOverlap(Policy):
    name = "max_overlap"

    def choose(self, req: RoutingQuery, workers: Sequence[WorkerView], now: float) -> str:
        return min(workers, key=lambda w: (-req.matches.get(w.id, 0), load_of(w))).id
