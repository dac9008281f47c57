"""session-affinity: cost 0 for the session's ring owner among the candidates, 1 for the others."""

import pytest

from kvmesh.routing.scorers import SessionAffinityScorer
from kvmesh.routing.types import RoutingQuery, WorkerView

pytestmark = pytest.mark.unit
WS = [WorkerView(f"w{i}") for i in range(6)]


def test_same_session_same_owner_and_no_session_is_neutral() -> None:
    s = SessionAffinityScorer()
    first = s.score(RoutingQuery("r1", 10, session_id="sess-42"), WS, WS)
    assert sorted(first) == [0.0] + [1.0] * 5
    for i in range(5):
        assert s.score(RoutingQuery(f"r{i}", 10, session_id="sess-42"), WS, WS) == first
    assert s.score(RoutingQuery("r", 10), WS, WS) == [0.0] * 6


def test_filtered_owner_falls_back_then_returns() -> None:
    s = SessionAffinityScorer()
    req = RoutingQuery("r", 10, session_id="conversation-7")
    owner = WS[s.score(req, WS, WS).index(0.0)].id
    others = [w for w in WS if w.id != owner]
    fallback = s.score(req, others, WS)
    assert fallback.count(0.0) == 1  # someone else takes it while the owner is filtered out
    assert WS[s.score(req, WS, WS).index(0.0)].id == owner  # and it comes back
