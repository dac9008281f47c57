"""Baselines: round-robin cycles, random is uniform-ish, least-loaded takes the fewest requests."""

import collections

import pytest

from kvmesh.routing.pickers import LeastLoadedPicker, RandomPicker, RoundRobinPicker
from kvmesh.routing.types import RoutingQuery, WorkerView

pytestmark = pytest.mark.unit
WS = [WorkerView("a"), WorkerView("b"), WorkerView("c")]
REQ = RoutingQuery("r", 1)


def test_round_robin_cycles() -> None:
    p = RoundRobinPicker()
    assert [p.pick(REQ, WS, []) for _ in range(7)] == [0, 1, 2, 0, 1, 2, 0]


def test_random_covers_all_and_is_seeded() -> None:
    a = [RandomPicker(seed=5).pick(REQ, WS, []) for _ in range(1)]
    b = [RandomPicker(seed=5).pick(REQ, WS, []) for _ in range(1)]
    assert a == b
    p = RandomPicker(seed=9)
    counts = collections.Counter(p.pick(REQ, WS, []) for _ in range(3000))
    assert all(900 < counts[i] < 1100 for i in range(3))


def test_least_loaded_counts_reports_and_inflight() -> None:
    p = LeastLoadedPicker(seed=0)
    ws = [WorkerView("a", running=3), WorkerView("b", waiting=1, inflight_requests=1), WorkerView("c", running=5)]
    assert p.pick(REQ, ws, []) == 1
    ws[1].inflight_requests = 9
    assert p.pick(REQ, ws, []) == 0
