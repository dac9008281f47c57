"""Circuit filter: keep w iff its breaker state is CLOSED, or HALF_OPEN (a probe slot is free).

The service computes `w.circuit` from `kvmesh.routing.circuit.CircuitBreaker.view_state(now)`, which reports
HALF_OPEN only while a probe may be sent, so a half-open worker receives at most its probe budget.
`allow_half_open: false` keeps only CLOSED workers (then a recovering worker is probed by other means).

Panic mode (`fail_open: true`, the default): if the filter would remove *every* worker, it returns its input
unchanged. Slow workers are better than none; dead ones are removed by the `healthy` filter anyway (their
load stream broke). With `fail_open: false` the pipeline rejects the request instead.
"""

from __future__ import annotations

from collections.abc import Sequence

from kvmesh.routing.plugin import FILTERS, register
from kvmesh.routing.types import CircuitState, RoutingQuery, WorkerView


@register(FILTERS, "circuit-closed")
class CircuitClosedFilter:
    """keep(w) = w.circuit == CLOSED or (allow_half_open and w.circuit == HALF_OPEN); all if none (fail_open)"""

    name = "circuit-closed"

    def __init__(self, allow_half_open: bool = True, fail_open: bool = True) -> None:
        self.fail_open = fail_open
        self.allowed = {CircuitState.CLOSED, CircuitState.HALF_OPEN} if allow_half_open else {CircuitState.CLOSED}

    def filter(self, req: RoutingQuery, workers: Sequence[WorkerView]) -> Sequence[WorkerView]:
        allowed = self.allowed
        out = [w for w in workers if w.circuit in allowed]
        if not out and self.fail_open:
            return workers
        return out
