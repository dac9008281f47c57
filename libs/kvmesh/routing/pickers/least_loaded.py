"""Least-loaded baseline: fewest requests, ignoring the prefix index.

    load(w) = running(w) + waiting(w) + inflight_requests(w)
    pick    = argmin load, exact ties broken at random

(This router's own in-flight requests are added so a burst between two load reports spreads; requests
already in the report are counted twice, which only matters between reports — what simple least-loaded
balancers such as "shortest queue" do.)
"""

from __future__ import annotations

import random
from collections.abc import Sequence

from kvmesh.routing.plugin import PICKERS, register
from kvmesh.routing.types import RoutingQuery, WorkerView


@register(PICKERS, "least-loaded")
class LeastLoadedPicker:
    """pick = argmin (running + waiting + inflight_requests)"""

    name = "least-loaded"

    def __init__(self, seed: int | None = None) -> None:
        self.rng = random.Random(seed)

    def pick(self, req: RoutingQuery, candidates: Sequence[WorkerView], totals: Sequence[float]) -> int:
        loads = [w.running + w.waiting + w.inflight_requests for w in candidates]
        low = min(loads)
        ties = [i for i, v in enumerate(loads) if v == low]
        return ties[0] if len(ties) == 1 else self.rng.choice(ties)
