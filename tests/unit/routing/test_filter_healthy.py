"""healthy and not-draining filters keep exactly the workers allowed to take new work."""

import pytest

from kvmesh.routing.filters import HealthyFilter, NotDrainingFilter
from kvmesh.routing.types import RoutingQuery, WorkerView

pytestmark = pytest.mark.unit
REQ = RoutingQuery("r", prompt_tokens=10)


def test_healthy_keeps_only_healthy_in_order() -> None:
    ws = [WorkerView("a"), WorkerView("b", healthy=False), WorkerView("c")]
    assert [w.id for w in HealthyFilter().filter(REQ, ws)] == ["a", "c"]


def test_not_draining_drops_draining_and_keeps_input_untouched() -> None:
    ws = [WorkerView("a", draining=True), WorkerView("b")]
    out = NotDrainingFilter().filter(REQ, ws)
    assert [w.id for w in out] == ["b"]
    assert len(ws) == 2


def test_all_unhealthy_gives_empty() -> None:
    assert list(HealthyFilter().filter(REQ, [WorkerView("a", healthy=False)])) == []
