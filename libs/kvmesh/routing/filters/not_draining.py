"""Not-draining filter: keep w iff `not w.draining` (operator drain or SIGTERM: no new work)."""

from __future__ import annotations

from collections.abc import Sequence

from kvmesh.routing.plugin import FILTERS, register
from kvmesh.routing.types import RoutingQuery, WorkerView


@register(FILTERS, "not-draining")
class NotDrainingFilter:
    """keep(w) = not w.draining"""

    name = "not-draining"

    def filter(self, req: RoutingQuery, workers: Sequence[WorkerView]) -> Sequence[WorkerView]:
        return [w for w in workers if not w.draining]
