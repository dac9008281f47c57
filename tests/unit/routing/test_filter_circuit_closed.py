"""circuit-closed filter: CLOSED always, HALF_OPEN only when allowed, OPEN never."""

import pytest

from kvmesh.routing.filters import CircuitClosedFilter
from kvmesh.routing.types import CircuitState, RoutingQuery, WorkerView

pytestmark = pytest.mark.unit
REQ = RoutingQuery("r", prompt_tokens=10)
WS = [
    WorkerView("closed"),
    WorkerView("open", circuit=CircuitState.OPEN),
    WorkerView("half", circuit=CircuitState.HALF_OPEN),
]


def test_default_allows_half_open_probe() -> None:
    assert [w.id for w in CircuitClosedFilter().filter(REQ, WS)] == ["closed", "half"]


def test_strict_keeps_only_closed() -> None:
    assert [w.id for w in CircuitClosedFilter(allow_half_open=False).filter(REQ, WS)] == ["closed"]


def test_all_open_fails_open_unless_strict() -> None:
    ws = [WorkerView("a", circuit=CircuitState.OPEN), WorkerView("b", circuit=CircuitState.OPEN)]
    assert [w.id for w in CircuitClosedFilter().filter(REQ, ws)] == ["a", "b"]
    assert list(CircuitClosedFilter(fail_open=False).filter(REQ, ws)) == []
