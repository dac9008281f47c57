"""pool filter: prompts over the threshold go to "long" (or shared) workers, others to "short"."""

import pytest

from kvmesh.routing.filters import PoolFilter
from kvmesh.routing.types import RoutingQuery, WorkerView

pytestmark = pytest.mark.unit
WS = [WorkerView("l", pool="long"), WorkerView("s", pool="short"), WorkerView("any")]


def ids(ws: object) -> list[str]:
    return [w.id for w in ws]  # type: ignore[attr-defined]


def test_long_and_short_split_at_threshold() -> None:
    f = PoolFilter(long_prompt_tokens=2048)
    assert ids(f.filter(RoutingQuery("r", prompt_tokens=2048), WS)) == ["s", "any"]
    assert ids(f.filter(RoutingQuery("r", prompt_tokens=2049), WS)) == ["l", "any"]


def test_soft_falls_back_strict_does_not() -> None:
    only_short = [WorkerView("s", pool="short")]
    req = RoutingQuery("r", prompt_tokens=5000)
    assert ids(PoolFilter().filter(req, only_short)) == ["s"]
    assert ids(PoolFilter(strict=True).filter(req, only_short)) == []
