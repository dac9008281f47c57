"""Healthy filter: keep w iff `w.healthy` (health serving and load reports fresh, as the service sets it)."""

from __future__ import annotations

from collections.abc import Sequence

from kvmesh.routing.plugin import FILTERS, register
from kvmesh.routing.types import RoutingQuery, WorkerView


@register(FILTERS, "healthy")
class HealthyFilter:
    """keep(w) = w.healthy"""

    name = "healthy"

    def filter(self, req: RoutingQuery, workers: Sequence[WorkerView]) -> Sequence[WorkerView]:
        return [w for w in workers if w.healthy]
