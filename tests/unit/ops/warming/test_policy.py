"""Warming: sliding-window statistics, dynamic/static decisions, hybrid LFU+LRU warm set."""

from __future__ import annotations

import pytest

from kvmesh.ops.warming import (
    HybridWarmSet,
    PrefixStats,
    WarmingConfig,
    checkpoints,
    load_templates,
    plan_dynamic,
    plan_static,
)
from kvmesh.ops.warming.decide import target_replicas

BS = 2


def hashes(prefix_id: int, n: int) -> list[int]:
    """Distinct chained-looking hashes: block i of prefix `prefix_id`."""
    return [prefix_id * 1000 + i for i in range(n)]


@pytest.mark.unit
def test_checkpoints() -> None:
    assert checkpoints(0) == []
    assert checkpoints(1) == [1]
    assert checkpoints(5) == [1, 2, 4, 5]
    assert checkpoints(8) == [1, 2, 4, 8]


@pytest.mark.unit
def test_sliding_window_counts_expire_exactly() -> None:
    s = PrefixStats(window_s=60.0)
    for t in range(5):
        s.observe(hashes(1, 4), now=float(t * 10))  # t = 0, 10, 20, 30, 40
    key = hashes(1, 4)[-1]
    assert s.rate(key, 40.0) == 5
    assert s.rate(key, 60.0) == 4  # the observation at t=0 left the window (60 - 60 = 0, exclusive)
    assert s.rate(key, 99.9) == 1
    assert s.rate(key, 100.0) == 0
    assert key not in s.info  # forgotten when nothing is left in the window


@pytest.mark.unit
def test_hot_prefers_longest_hot_prefix() -> None:
    s = PrefixStats()
    shared = hashes(7, 8)
    for i in range(6):  # shared 8-block prefix, then different tails
        s.observe(shared + [90_000 + i * 10 + j for j in range(3)], now=float(i))
    hot = s.hot(6.0, threshold=5)
    assert [k for k, _ in hot] == [shared[7]]  # not blocks 1, 2, 4 (dominated) nor the unique tails
    assert hot[0][1].n_blocks == 8 and hot[0][1].count == 6


@pytest.mark.unit
def test_top_is_most_seen_then_longest_within_the_window() -> None:
    s = PrefixStats(window_s=60.0)
    shared = hashes(7, 8)
    for i in range(3):  # the shared 8-block prefix three times, with a different 2-block tail each time
        s.observe(shared + [90_000 + i * 10 + j for j in range(2)], now=float(i))
    s.observe(hashes(3, 2), now=3.0)  # a 2-block prompt once
    top = s.top(10.0, 3)
    assert [(v.n_blocks, v.count) for _, v in top] == [(8, 3), (4, 3), (2, 3)]  # checkpoints of the shared one
    assert top[0][0] == shared[7]
    assert len(s.top(10.0, 100)) == len(s.info) and s.top(10.0, 0) == []
    assert s.top(62.5, 10) == [(k, v) for k, v in s.top(62.5, 10) if v.count == 1]  # the first two left the window


@pytest.mark.unit
def test_dynamic_warming_picks_least_loaded_non_holders() -> None:
    cfg = WarmingConfig(threshold=5, max_replicas=3)
    s = PrefixStats(window_s=60.0)
    toks = list(range(16))
    for i in range(10):
        s.observe(hashes(1, 8), now=float(i), token_ids=toks, block_size=BS)
    for i in range(4):  # below threshold: never warmed
        s.observe(hashes(2, 8), now=float(i), token_ids=toks, block_size=BS)
    loads = {"a": 0.5, "b": 0.1, "c": 0.3, "d": 0.95, "e": 0.2}
    plan = plan_dynamic(s, 10.0, loads, lambda k, inf: {"e"}, HybridWarmSet(1000), cfg)
    # rate 10 → target min(3, 1 + 10 // 5) = 3; holder e; d too loaded → b, c
    assert [(a.worker, a.reason) for a in plan.actions] == [("b", "dynamic"), ("c", "dynamic")]
    assert all(a.key == hashes(1, 8)[-1] and a.token_ids == tuple(toks) for a in plan.actions)
    # once the window has passed, nothing is hot any more
    assert plan_dynamic(s, 100.0, loads, lambda k, inf: set(), HybridWarmSet(1000), cfg).actions == []


@pytest.mark.unit
def test_target_replicas_formula() -> None:
    cfg = WarmingConfig(threshold=5, max_replicas=4)
    assert [target_replicas(r, cfg) for r in (5, 9, 10, 14, 15, 100)] == [2, 2, 3, 3, 4, 4]


@pytest.mark.unit
def test_hybrid_policy_lfu_and_lru_limits() -> None:
    # long half-life: frequency wins (LFU-like): the frequent old prefix survives
    lfu = HybridWarmSet(capacity=2, half_life_s=1e9)
    lfu.admit(1, 1, 0.0)
    for t in range(1, 6):
        lfu.touch(1, float(t))
    lfu.admit(2, 1, 10.0)
    lfu.touch(2, 11.0)
    ok, evicted = lfu.admit(3, 1, 12.0, hits=3.0)
    assert ok and evicted == [2] and set(lfu.entries) == {1, 3}
    # short half-life: recency wins (LRU-like): the old frequent one is evicted
    lru = HybridWarmSet(capacity=2, half_life_s=0.5)
    lru.admit(1, 1, 0.0)
    for t in range(1, 6):
        lru.touch(1, float(t) / 10)
    lru.admit(2, 1, 10.0)
    ok, evicted = lru.admit(3, 1, 10.5, hits=1.0)
    assert ok and evicted == [1]


@pytest.mark.unit
def test_hybrid_score_formula_and_capacity() -> None:
    ws = HybridWarmSet(capacity=10, half_life_s=10.0)
    ws.admit(1, 4, 0.0, hits=2.0)
    ws.touch(1, 10.0)  # 2 · 2^(−1) + 1 = 2
    assert ws.score(1, 10.0) == pytest.approx(2.0)
    assert ws.score(1, 20.0) == pytest.approx(1.0)
    ok, _ = ws.admit(2, 20, 20.0, hits=100.0)
    assert not ok  # larger than the capacity
    ok, ev = ws.admit(3, 7, 20.0, hits=0.5)
    assert not ok and ev == []  # a colder newcomer does not push out a hotter resident
    ok, ev = ws.admit(4, 7, 20.0, hits=5.0, pinned=True)
    assert ok and ev == [1] and ws.used == 7
    ok, ev = ws.admit(5, 7, 21.0, hits=1e6)
    assert not ok and ev == []  # pinned entries are never evicted


@pytest.mark.unit
def test_static_templates_plan() -> None:
    ts = load_templates(
        [{"name": "sys", "token_ids": [1, 2, 3, 4], "replicas": 2}, {"name": "all", "text": "x y", "replicas": 0}],
        tokenize=lambda s: [ord(c) for c in s],
    )
    loads = {"a": 0.2, "b": 0.1, "c": 0.9}
    warm = HybridWarmSet(100)
    plan = plan_static(ts, loads, lambda t: {"a"} if t.name == "sys" else set(), warm, block_size=2)
    assert [(a.worker, a.key) for a in plan.actions] == [("b", 0), ("b", 1), ("a", 1), ("c", 1)]
    assert all(e.pinned for e in warm.entries.values())
    with pytest.raises(ValueError):
        load_templates([{"name": "bad"}])


@pytest.mark.unit
def test_stats_export_restore_roundtrip() -> None:
    s = PrefixStats(window_s=30.0)
    s.observe(hashes(3, 5), 1.0, token_ids=list(range(10)), block_size=BS)
    r = PrefixStats.restore(s.export())
    assert r.export() == s.export() and r.rate(hashes(3, 5)[-1], 2.0) == 1
