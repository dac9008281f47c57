"""node-health: cost = 1 - (0.6·(1 - load) + 0.3·(1 - mem_util) + 0.1·version_match)."""

import pytest

from kvmesh.routing.scorers import NodeHealthScorer
from kvmesh.routing.types import RoutingQuery, WorkerView

pytestmark = pytest.mark.unit
REQ = RoutingQuery("r", prompt_tokens=1)


def test_formula_with_max_queue_and_version() -> None:
    s = NodeHealthScorer(version="v2")
    a = WorkerView("a", running=2, waiting=2, max_queue=8, kv_usage=0.4, version="v2")
    b = WorkerView("b", running=8, waiting=8, max_queue=8, kv_usage=1.0, version="v1")
    assert s.health(a, 0) == pytest.approx(0.6 * 0.5 + 0.3 * 0.6 + 0.1)
    assert s.score(REQ, [a, b], [a, b]) == pytest.approx([1 - 0.58, 1.0])


def test_relative_load_without_max_queue() -> None:
    s = NodeHealthScorer()
    a, b = WorkerView("a", running=1), WorkerView("b", running=4)
    assert s.score(REQ, [a, b], [a, b]) == pytest.approx([1 - (0.6 * 0.75 + 0.4), 1 - 0.4])
