"""Warming's load ceiling at its edge: a worker whose load is exactly `max_load` (default 0.9) gets no warming,
one just below it does; the least-loaded order, the `want` count and the per-round action cap at their edges."""

from __future__ import annotations

import pytest

from kvmesh.ops.warming import HybridWarmSet, PrefixStats, WarmingConfig, plan_dynamic, plan_static
from kvmesh.ops.warming.decide import pick_workers, target_replicas
from kvmesh.ops.warming.templates import Template

pytestmark = pytest.mark.unit
BS = 2
TOKENS = list(range(16))


def test_the_default_ceiling_is_0_9_and_exclusive() -> None:
    cfg = WarmingConfig()
    assert cfg.max_load == 0.9
    loads = {"at": 0.9, "below": 0.8999, "idle": 0.0}
    assert pick_workers(set(), loads, 5, cfg.max_load) == ["idle", "below"]


@pytest.mark.parametrize(("load", "picked"), [(0.5, False), (0.4999, True), (0.5001, False)])
def test_a_load_exactly_at_the_ceiling_is_skipped(load: float, picked: bool) -> None:
    assert (pick_workers(set(), {"w": load}, 1, 0.5) == ["w"]) is picked


def test_least_loaded_first_then_by_id_and_exactly_want() -> None:
    loads = {"b": 0.2, "a": 0.2, "c": 0.1, "d": 0.3}
    assert pick_workers(set(), loads, 2, 0.9) == ["c", "a"]
    assert pick_workers(set(), loads, 4, 0.9) == ["c", "a", "b", "d"]
    assert pick_workers({"c"}, loads, 1, 0.9) == ["a"]  # holders are never picked
    assert pick_workers(set(), loads, 0, 0.9) == [] and pick_workers(set(), loads, -1, 0.9) == []


def _stats(count: int) -> PrefixStats:
    s = PrefixStats(window_s=60.0)
    for i in range(count):
        s.observe([100 + k for k in range(8)], now=float(i), token_ids=TOKENS, block_size=BS)
    return s


def test_dynamic_warming_skips_a_worker_exactly_at_the_ceiling() -> None:
    cfg = WarmingConfig(threshold=5, max_replicas=4)  # rate 10: target 3
    loads = {"at": 0.9, "under": 0.89, "idle": 0.1}
    plan = plan_dynamic(_stats(10), 10.0, loads, lambda k, inf: set(), HybridWarmSet(1000), cfg)
    assert [a.worker for a in plan.actions] == ["idle", "under"]


def test_dynamic_warming_stops_at_max_actions_exactly() -> None:
    cfg = WarmingConfig(threshold=5, max_replicas=4, max_actions=2)
    loads = {f"w{i}": 0.1 * i for i in range(5)}
    plan = plan_dynamic(_stats(10), 10.0, loads, lambda k, inf: set(), HybridWarmSet(1000), cfg)
    assert [a.worker for a in plan.actions] == ["w0", "w1"]  # target 3, room 2


def test_rate_exactly_at_the_threshold_is_hot_and_one_below_is_not() -> None:
    cfg = WarmingConfig(threshold=5, max_replicas=4)
    loads = {"a": 0.1, "b": 0.2, "c": 0.3}
    assert target_replicas(4, cfg) == 1 and target_replicas(5, cfg) == 2
    assert plan_dynamic(_stats(4), 10.0, loads, lambda k, inf: set(), HybridWarmSet(1000), cfg).actions == []
    plan = plan_dynamic(_stats(5), 10.0, loads, lambda k, inf: set(), HybridWarmSet(1000), cfg)
    assert [a.worker for a in plan.actions] == ["a", "b"]  # 1 + 5 // 5 = 2
    cfg4 = WarmingConfig(threshold=5, max_replicas=2)
    assert target_replicas(100, cfg4) == 2


def test_static_preload_ceiling_is_1_0_by_default_and_exclusive() -> None:
    t = Template(name="sys", token_ids=(1, 2, 3, 4), replicas=0)
    loads = {"full": 1.0, "busy": 0.99, "idle": 0.0}
    plan = plan_static([t], loads, lambda t: set())
    assert [a.worker for a in plan.actions] == ["idle", "busy"]
    plan = plan_static([t], loads, lambda t: set(), max_load=0.99)
    assert [a.worker for a in plan.actions] == ["idle"]
