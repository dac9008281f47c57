"""The batching window at the fleet simulator's worker admission (`FleetConfig.batching`): requests arriving
inside one window enter the engine together at its close, shortest prompt first, under the token budget; with
no window they enter at arrival, in arrival order."""

from __future__ import annotations

import pytest

from kvmesh.core.generation import EngineRequest
from kvmesh.engine.batching import WindowConfig
from kvmesh.fleet.policies import make_policy
from kvmesh.fleet.sim import FleetConfig, FleetSim
from kvmesh.fleet.trace import ChunkIds, Trace, TraceRequest

pytestmark = pytest.mark.unit

ARRIVALS = ((0.0, 3000), (0.01, 1000), (0.02, 2000))  # (arrival s, prompt tokens)


def trace() -> Trace:
    ids = ChunkIds(7)
    reqs = [TraceRequest(i, t, n, 8, ids.take(-(-n // 512))) for i, (t, n) in enumerate(ARRIVALS)]
    return Trace("three", reqs)


def entries(batching: WindowConfig | None) -> tuple[list[tuple[str, float]], FleetSim]:
    """(request id, simulated time) of every request as it is queued on the single worker's engine."""
    sim = FleetSim(trace(), make_policy("kvmesh"), FleetConfig(workers=1, batching=batching))
    engine = sim.engines[0]
    seen: list[tuple[str, float]] = []
    add = engine.add_request

    def spy(req: EngineRequest, now: float) -> None:
        seen.append((req.request_id, now))
        add(req, now)

    engine.add_request = spy  # type: ignore[method-assign]
    res = sim.run()
    assert res.rejected == 0 and len(res.records) == 3 and all(r.finish > 0 for r in res.records)
    return seen, sim


def test_without_a_window_requests_enter_at_arrival() -> None:
    seen, _ = entries(None)
    assert seen == [("0", 0.0), ("1", 0.01), ("2", 0.02)]


def test_a_window_admits_shortest_first_at_its_close() -> None:
    seen, sim = entries(WindowConfig(0.05, 0.1, generation_max_tokens=256, token_budget=10_000))
    assert [r for r, _ in seen] == ["1", "2", "0"]  # 1000, 2000, 3000 tokens
    assert [t for _, t in seen] == [pytest.approx(0.05)] * 3  # the first arrival's QA window
    assert sim.windows is not None and sim.windows.stats()["releases"] == 1


def test_what_does_not_fit_the_budget_waits_for_the_next_release() -> None:
    seen, sim = entries(WindowConfig(0.05, 0.1, generation_max_tokens=256, token_budget=3500))
    assert [r for r, _ in seen] == ["1", "2", "0"]
    assert [t for _, t in seen] == [pytest.approx(0.05), pytest.approx(0.05), pytest.approx(0.10)]
    assert sim.records[0] is not None and sim.records[0].arrival == 0.0  # TTFT counts the wait
