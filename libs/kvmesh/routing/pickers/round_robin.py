"""Round-robin baseline: pick = counter mod |candidates|, counter += 1 (ignores costs and the index)."""

from __future__ import annotations

from collections.abc import Sequence

from kvmesh.routing.plugin import PICKERS, register
from kvmesh.routing.types import RoutingQuery, WorkerView


@register(PICKERS, "round-robin")
class RoundRobinPicker:
    """pick = k mod n for the k-th decision"""

    name = "round-robin"

    def __init__(self, start: int = 0) -> None:
        self.counter = start

    def pick(self, req: RoutingQuery, candidates: Sequence[WorkerView], totals: Sequence[float]) -> int:
        i = self.counter % len(candidates)
        self.counter += 1
        return i
