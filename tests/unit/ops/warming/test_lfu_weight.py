"""The operator's `lfu_weight` in the keep-warm score, and the tenant kept with prefix statistics."""

from __future__ import annotations

import pytest

from kvmesh.ops.warming import HybridWarmSet, PrefixStats, WarmingConfig, plan_dynamic

pytestmark = pytest.mark.unit


def frequent_old_vs_recent_once(w: float) -> list[int]:
    """Prefix 1: 6 accesses long ago; prefix 2: 1 access just now; a newcomer (3) needs one slot."""
    ws = HybridWarmSet(capacity=2, half_life_s=1.0, lfu_weight=w)
    ws.admit(1, 1, 0.0)
    for t in range(1, 6):
        ws.touch(1, float(t) / 10)
    ws.admit(2, 1, 100.0)
    ok, evicted = ws.admit(3, 1, 100.0, hits=2.0)
    assert ok
    return evicted


def test_weight_one_is_lfu_and_weight_zero_is_lru() -> None:
    assert frequent_old_vs_recent_once(1.0) == [2]  # count 6 beats count 1: the recent one goes
    assert frequent_old_vs_recent_once(0.0) == [1]  # recency only: the old one goes


def test_blend_formula() -> None:
    ws = HybridWarmSet(capacity=10, half_life_s=10.0, lfu_weight=0.25)
    ws.admit(1, 1, 0.0, hits=2.0)
    ws.touch(1, 10.0)  # n = 3, last access at 10
    assert ws.score(1, 10.0) == pytest.approx(0.25 * 3 + 0.75 * 1.0)
    assert ws.score(1, 20.0) == pytest.approx(0.25 * 3 + 0.75 * 0.5)
    ws.set_lfu_weight(None)  # back to the LRFU decayed count: 2 · 2^(−1) + 1 = 2 at t = 10
    assert ws.score(1, 10.0) == pytest.approx(2.0)


def test_weight_is_validated() -> None:
    for bad in (-0.1, 1.5, float("nan")):
        with pytest.raises(ValueError):
            HybridWarmSet(10, lfu_weight=bad)


def test_tenant_of_a_hot_prefix_reaches_the_warming_action() -> None:
    s = PrefixStats()
    for t in range(5):
        s.observe([11, 12], float(t), token_ids=list(range(8)), block_size=4, tenant="A")
    plan = plan_dynamic(
        s, 5.0, {"w1": 0.0, "w2": 0.0}, lambda k, inf: {"w1"}, HybridWarmSet(100), WarmingConfig(threshold=5)
    )
    assert [(a.worker, a.tenant, a.token_ids) for a in plan.actions] == [("w2", "A", tuple(range(8)))]
    back = PrefixStats.restore(s.export())
    assert back.info[12].tenant == "A"
    old = s.export()
    old["info"] = [row[:7] for row in old["info"]]  # type: ignore[attr-defined]  # snapshot before `tenant`
    assert PrefixStats.restore(old).info[12].tenant is None
