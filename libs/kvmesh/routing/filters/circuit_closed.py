"""Circuit filter: keep w iff its breaker state is CLOSED, or HALF_OPEN (a probe slot is free).

The service computes `w.circuit` from `kvmesh.routing.circuit.CircuitBreaker.view_state(now)`, which reports
HALF_OPEN only while a probe may be sent, so a half-open worker receives at most its probe budget.
`allow_half_open: false` keeps only CLOSED workers (then a recovering worker is probed by other means).
"""

from __future__ import annotations

from collections.abc import Sequence

from kvmesh.routing.plugin import FILTERS, register
from kvmesh.routing.types import CircuitState, RouteRequest, WorkerView


@register(FILTERS, "circuit-closed")
class CircuitClosedFilter:
    """keep(w) = w.circuit == CLOSED or (allow_half_open and w.circuit == HALF_OPEN)"""

    name = "circuit-closed"

    def __init__(self, allow_half_open: bool = True) -> None:
        self.allowed = {CircuitState.CLOSED, CircuitState.HALF_OPEN} if allow_half_open else {CircuitState.CLOSED}

    def filter(self, req: RouteRequest, workers: Sequence[WorkerView]) -> Sequence[WorkerView]:
        allowed = self.allowed
        return [w for w in workers if w.circuit in allowed]
