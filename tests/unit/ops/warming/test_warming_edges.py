"""Warming at its edges beyond the load ceiling: the per-round action cap stops the round, static templates'
keys, sizes and pins, template validation's messages, the warm set's discard and decay, replication's
boundaries (a 1-block prefix, a prefix exactly the burst), and snapshots of prefixes whose tokens are unknown."""

from __future__ import annotations

import numpy as np
import pytest

from kvmesh.ops.warming import HybridWarmSet, PrefixStats, WarmingConfig, load_templates, plan_dynamic, plan_static
from kvmesh.ops.warming.replicate import ByteBudget, Candidate, candidates, unfinished
from kvmesh.ops.warming.stats import PrefixInfo, checkpoint_keys
from kvmesh.ops.warming.templates import Template

pytestmark = pytest.mark.unit
BS = 2
LOADS = {"a": 0.1, "b": 0.2, "c": 0.3, "d": 0.4}


def _observe(s: PrefixStats, first_hash: int, times: int, tokens: list[int] | None) -> int:
    """`times` observations of a 4-block prompt; returns its full-prefix key."""
    hashes = [first_hash + k for k in range(4)]
    for i in range(times):
        s.observe(hashes, now=float(i), token_ids=tokens, block_size=BS if tokens is not None else 0)
    return hashes[-1]


# --- dynamic warming: the round's cap, prefixes without tokens, the warm set it fills


def test_the_round_stops_at_max_actions_and_leaves_later_prefixes_alone() -> None:
    s = PrefixStats(window_s=60.0)
    first = _observe(s, 100, 10, list(range(8)))  # rate 10: target 3
    second = _observe(s, 200, 6, list(range(8, 16)))  # rate 6: target 2
    warm = HybridWarmSet(1000)
    plan = plan_dynamic(s, 10.0, LOADS, lambda k, inf: set(), warm, WarmingConfig(threshold=5, max_actions=3))
    assert plan is not None
    assert [(a.worker, a.key) for a in plan.actions] == [("a", first), ("b", first), ("c", first)]
    assert second not in warm.entries and plan.rejected == [] and plan.cooled == []  # never considered


def test_a_hot_prefix_without_tokens_is_skipped_and_the_next_one_still_warmed() -> None:
    s = PrefixStats(window_s=60.0)
    unknown = _observe(s, 100, 10, None)  # hotter, but its tokens were never seen
    known = _observe(s, 200, 6, list(range(8)))
    warm = HybridWarmSet(1000)
    plan = plan_dynamic(s, 10.0, LOADS, lambda k, inf: set(), warm, WarmingConfig(threshold=5))
    assert [(a.worker, a.key, a.token_ids, a.reason) for a in plan.actions] == [
        ("a", known, tuple(range(8)), "dynamic"),
        ("b", known, tuple(range(8)), "dynamic"),
    ]
    assert unknown not in warm.entries


def test_a_warmed_prefix_enters_the_warm_set_under_its_key_at_the_rounds_time() -> None:
    s = PrefixStats(window_s=60.0)
    key = _observe(s, 100, 10, list(range(8)))
    warm = HybridWarmSet(1000, half_life_s=10.0)
    plan_dynamic(s, 12.0, LOADS, lambda k, inf: set(), warm, WarmingConfig(threshold=5, max_replicas=4))
    entry = warm.entries[key]
    assert (entry.size, entry.last, entry.score) == (4 * 3, 12.0, 10.0)  # 4 blocks x target 3, hits = rate
    assert warm.score(key, 22.0) == pytest.approx(5.0)


# --- static preload: keys, sizes, pins, the action's fields


def test_static_preload_keys_sizes_and_actions() -> None:
    templates = [Template("five", (1, 2, 3, 4, 5), 1), Template("one", (9,), 1)]
    warm = HybridWarmSet(100)
    plan = plan_static(templates, {"a": 0.1}, lambda t: set(), warm, key_of=lambda t: hash(t.name), block_size=2)
    assert [(a.worker, a.key, a.token_ids, a.reason) for a in plan.actions] == [
        ("a", hash("five"), (1, 2, 3, 4, 5), "static"),
        ("a", hash("one"), (9,), "static"),
    ]
    sizes = {k: (e.size, e.pinned) for k, e in warm.entries.items()}
    assert sizes == {hash("five"): (2, True), hash("one"): (1, True)}  # whole blocks, at least one
    assert all(isinstance(e.size, int) for e in warm.entries.values())
    assert warm.used == 3 and warm.score(hash("five"), 1.0) > 0.0  # a live entry with a score


def test_static_preload_defaults_key_by_position_and_size_by_token() -> None:
    warm = HybridWarmSet(100)
    plan_static([Template("x", (1, 2, 3), 1), Template("y", (4, 5), 1)], {"a": 0.1}, lambda t: set(), warm)
    assert {k: e.size for k, e in warm.entries.items()} == {0: 3, 1: 2}  # block_size 1: one block a token


# --- templates: defaults and the messages that name the template


def test_template_defaults_name_by_position_and_one_replica() -> None:
    (a, b) = load_templates([{"token_ids": [1]}, {"name": "n", "text": "hi"}], tokenize=lambda s: [len(s)] * 2)
    assert (a.name, a.token_ids, a.replicas) == ("template-0", (1,), 1)
    assert (b.name, b.token_ids, b.replicas) == ("n", (2, 2), 1)  # the text itself is tokenised


@pytest.mark.parametrize(
    ("item", "message"),
    [
        ({"name": "t", "text": "x"}, "template 't': text needs a tokenizer"),
        ({"name": "t"}, "template 't': needs token_ids or text"),
        ({}, "template 'template-0': needs token_ids or text"),
        ({"name": "t", "token_ids": [1], "replicas": -1}, "template 't': replicas must be ≥ 0 and tokens non-empty"),
        ({"name": "t", "token_ids": []}, "template 't': replicas must be ≥ 0 and tokens non-empty"),
    ],
)
def test_a_bad_template_is_refused_naming_it(item: dict[str, object], message: str) -> None:
    with pytest.raises(ValueError) as e:
        load_templates([item])
    assert str(e.value) == message


def test_zero_replicas_means_every_worker_and_is_valid() -> None:
    (t,) = load_templates([{"name": "all", "token_ids": [1, 2], "replicas": 0}])
    assert t.replicas == 0
    plan = plan_static([t], {"a": 0.1, "b": 0.2}, lambda t: set())
    assert [a.worker for a in plan.actions] == ["a", "b"]


# --- the warm set: score of a stranger, decay from the last access, discard


def test_an_absent_prefix_scores_zero() -> None:
    assert HybridWarmSet(10).score(1, 5.0) == 0.0
    assert HybridWarmSet(10, lfu_weight=0.5).score(1, 5.0) == 0.0


def test_a_touch_decays_the_score_from_the_last_access_not_from_zero() -> None:
    ws = HybridWarmSet(10, half_life_s=10.0)
    ws.admit(1, 1, 100.0, hits=4.0)
    ws.touch(1, 110.0)  # one half-life later: 4 / 2 + 1
    assert ws.entries[1].score == pytest.approx(3.0) and ws.entries[1].last == 110.0
    ws.touch(2, 110.0)  # not warm: nothing happens
    assert 2 not in ws.entries


def test_discard_frees_the_blocks_of_that_prefix_only() -> None:
    ws = HybridWarmSet(10)
    ws.admit(1, 6, 0.0)
    ws.admit(2, 3, 0.0)
    ws.discard(1)
    assert set(ws.entries) == {2} and ws.used == 3
    ws.discard(1)  # gone already: nothing changes
    ws.discard(99)
    assert set(ws.entries) == {2} and ws.used == 3
    ok, evicted = ws.admit(3, 7, 0.0, hits=0.5)  # fits in what the discard freed, evicting nothing
    assert ok and evicted == [] and ws.used == 10


# --- replication: which prefixes are candidates, and when one can still go


def _info(n_blocks: int, tokens: tuple[int, ...] | None, tenant: str | None = "acme") -> PrefixInfo:
    return PrefixInfo(n_blocks, None, count=3, token_ids=tokens, tenant=tenant)


def test_candidates_keep_the_tenant_and_need_tokens_and_a_block() -> None:
    got = candidates([(1, _info(1, (1, 2))), (2, _info(0, ())), (3, _info(2, None)), (4, _info(2, (5,), None))])
    assert got == [Candidate(1, (1, 2), "acme", 1, 3), Candidate(4, (5,), None, 2, 3)]


def test_a_candidate_can_go_while_it_fits_the_burst_exactly() -> None:
    c = Candidate(1, (1, 2), None, 4, 3)
    assert unfinished([c], set(), 1, 4.0, lambda c: True)  # 4 blocks of 1 byte: exactly the burst
    assert not unfinished([c], set(), 1, 3.999, lambda c: True)
    assert unfinished([c], set(), 2, 8.0, lambda c: True) and not unfinished([c], set(), 2, 7.0, lambda c: True)
    assert not unfinished([c], set(), 0, 1e9, lambda c: True)  # no tier here: nothing can go
    assert not unfinished([c], {1}, 1, 4.0, lambda c: True) and not unfinished([c], set(), 1, 4.0, lambda c: False)


# --- snapshots: prefixes whose tokens are unknown


def test_a_snapshot_keeps_known_and_unknown_tokens_apart() -> None:
    s = PrefixStats(window_s=30.0)
    s.observe([10, 11], 1.0, token_ids=[1, 2, 3, 4], block_size=BS)
    s.observe([20, 21], 2.0)  # no tokens
    exported = s.export()
    rows = {row[0]: row[6] for row in exported["info"]}  # type: ignore[attr-defined]
    assert rows == {10: [1, 2], 11: [1, 2, 3, 4], 20: None, 21: None}
    restored = PrefixStats.restore(exported)
    assert restored.info[11].token_ids == (1, 2, 3, 4) and restored.info[21].token_ids is None
    assert restored.export() == exported


# --- dynamic warming across several hot prefixes in one round


def test_cooled_prefixes_accumulate_over_the_round() -> None:
    s = PrefixStats(window_s=60.0)
    first = _observe(s, 100, 10, list(range(8)))
    second = _observe(s, 200, 6, list(range(8, 16)))
    warm = HybridWarmSet(capacity=4 * 3 + 4 * 2, half_life_s=1e9)
    warm.admit(1, 4 * 3, 0.0, hits=0.5)  # two cold residents the two hot prefixes push out, one each
    warm.admit(2, 4 * 2, 0.0, hits=0.6)
    plan = plan_dynamic(s, 10.0, LOADS, lambda k, inf: set(), warm, WarmingConfig(threshold=5, max_replicas=3))
    assert plan.cooled == [1, 2] and first in warm.entries and second in warm.entries
    assert [k for k, _ in s.hot(10.0, 5)] == [first, second]  # first evicts 1, then second evicts 2


def test_a_prefix_the_warm_set_refuses_is_reported_and_the_round_goes_on() -> None:
    s = PrefixStats(window_s=60.0)
    big = _observe(s, 100, 10, list(range(8)))  # 4 blocks x target 3 = 12 > capacity
    small = [300, 301]
    for i in range(6):
        s.observe(small, now=float(i), token_ids=[1, 2, 3, 4], block_size=BS)  # 2 blocks x target 2 = 4
    warm = HybridWarmSet(capacity=10)
    plan = plan_dynamic(s, 10.0, LOADS, lambda k, inf: set(), warm, WarmingConfig(threshold=5, max_replicas=3))
    assert plan.rejected == [big]
    assert [(a.worker, a.key) for a in plan.actions] == [("a", small[-1]), ("b", small[-1])]


def test_holders_are_asked_about_the_prefix_being_warmed() -> None:
    s = PrefixStats(window_s=60.0)
    key = _observe(s, 100, 10, list(range(8)))
    asked: list[tuple[int, int]] = []

    def holders(k: int, inf: PrefixInfo) -> set[str]:
        asked.append((k, inf.n_blocks))
        return {"a"}

    plan = plan_dynamic(s, 10.0, LOADS, holders, HybridWarmSet(1000), WarmingConfig(threshold=5, max_replicas=3))
    assert asked == [(key, 4)] and [a.worker for a in plan.actions] == ["b", "c"]  # a holds it: 2 more


def test_the_cap_leaves_a_later_prefix_only_the_room_left() -> None:
    s = PrefixStats(window_s=60.0)
    first = _observe(s, 100, 6, list(range(8)))  # target 2
    second = _observe(s, 200, 5, list(range(8, 16)))  # target 2, room 1
    cfg = WarmingConfig(threshold=5, max_replicas=3, max_actions=3)
    plan = plan_dynamic(s, 10.0, LOADS, lambda k, inf: set(), HybridWarmSet(1000), cfg)
    assert [(a.worker, a.key) for a in plan.actions] == [("a", first), ("b", first), ("a", second)]


# --- the warm set's bounds and its tie rule


@pytest.mark.parametrize(("capacity", "half_life_s"), [(0, 1.0), (-1, 1.0), (1, 0.0), (1, -1.0)])
def test_the_warm_set_needs_a_positive_capacity_and_half_life(capacity: int, half_life_s: float) -> None:
    with pytest.raises(ValueError, match=r"^capacity and half_life_s must be positive$"):
        HybridWarmSet(capacity, half_life_s)


def test_a_one_block_warm_set_takes_a_one_block_prefix_exactly() -> None:
    assert HybridWarmSet(1).half_life_s == 120.0  # the default half-life
    ws = HybridWarmSet(1, half_life_s=0.001)
    assert ws.lfu_weight is None
    assert ws.admit(1, 1, 0.0) == (True, [])
    assert ws.admit(1, 1, 5.0) == (True, [])  # already warm: admitted, nothing evicted, nothing recounted
    assert ws.entries[1].count == 1.0 and ws.used == 1
    assert ws.admit(2, 2, 5.0) == (False, [])  # larger than the whole set


@pytest.mark.parametrize("w", [-0.01, 1.01])
def test_an_lfu_weight_outside_0_1_is_refused(w: float) -> None:
    with pytest.raises(ValueError, match=r"^lfu_weight must be in \[0, 1\]$"):
        HybridWarmSet(10, lfu_weight=w)
    assert HybridWarmSet(10, lfu_weight=0.0).lfu_weight == 0.0 and HybridWarmSet(10, lfu_weight=1.0).lfu_weight == 1.0


def test_a_newcomer_as_hot_as_the_coldest_resident_does_not_displace_it() -> None:
    ws = HybridWarmSet(2, half_life_s=1e12)
    ws.admit(1, 2, 0.0, hits=2.0)
    assert ws.admit(2, 1, 0.0, hits=2.0) == (False, [])  # a tie keeps the resident
    assert ws.admit(3, 1, 0.0, hits=2.5) == (True, [1])


def test_eviction_frees_victims_until_the_newcomer_fits() -> None:
    ws = HybridWarmSet(6, half_life_s=1e12)
    for key, hits in ((1, 1.0), (2, 2.0), (3, 3.0)):
        ws.admit(key, 2, 0.0, hits=hits)
    assert ws.admit(4, 3, 0.0, hits=5.0) == (True, [1, 2])  # 2 + 2 blocks freed for 3
    assert set(ws.entries) == {3, 4} and ws.used == 5


def test_in_pure_lru_a_newcomer_outranks_any_older_resident_whatever_its_hits() -> None:
    ws = HybridWarmSet(1, half_life_s=10.0, lfu_weight=0.0)
    ws.admit(1, 1, 0.0, hits=100.0)
    assert ws.score(1, 10.0) == pytest.approx(0.5)  # recency only: one half-life old
    assert ws.admit(2, 1, 10.0, hits=0.25) == (True, [1])  # scored as accessed now: 1.0


# --- replication's byte budget


@pytest.mark.parametrize(("rate", "burst"), [(0.0, 1.0), (1.0, 0.0), (-1.0, 1.0)])
def test_a_byte_budget_needs_a_positive_rate_and_burst(rate: float, burst: float) -> None:
    with pytest.raises(ValueError, match=r"^rate and burst must be positive$"):
        ByteBudget(rate, burst, now=0.0)


def test_a_byte_budget_of_fractional_rate_and_burst_is_valid() -> None:
    b = ByteBudget(0.5, 0.5, now=0.0)
    assert b.available(0.0) == 0.5
    b.spend(0.5)
    assert b.available(1.0) == 0.5


# --- statistics: checkpoint keys of an array, defaults, the order of hot prefixes, what observe keeps


def test_checkpoint_keys_of_an_array_are_python_ints() -> None:
    keys = checkpoint_keys(np.array([10, 11, 12, 13, 14], dtype=np.uint64))
    assert keys == [10, 11, 13, 14] and all(type(k) is int for k in keys)


def test_statistics_defaults() -> None:
    s = PrefixStats()
    assert (s.window_s, s.max_events, s.max_keys, s.keep_tokens_up_to) == (60.0, 1_000_000, 200_000, 131_072)


def test_hot_prefixes_come_most_seen_first_then_longest_then_by_key() -> None:
    s = PrefixStats(window_s=60.0)
    for key, n_blocks, times in ((40, 1, 5), (30, 1, 5), (60, 2, 5), (50, 1, 7)):
        for i in range(times):
            s.observe_keys(n_blocks, [key] if n_blocks == 1 else [key + 1000, key], now=float(i))
    assert [k for k, _ in s.hot(10.0, threshold=5)] == [50, 60, 30, 40]  # not in key order


def test_observe_keeps_tokens_only_with_a_block_size() -> None:
    s = PrefixStats()
    s.observe([10, 11], 1.0, token_ids=[1, 2, 3, 4])  # block size 0 (default): tokens not kept
    s.observe_keys(1, [20], 1.0, token_ids=[1, 2])
    s.observe([30, 31], 1.0, block_size=2)  # no tokens
    assert [s.info[k].token_ids for k in (10, 11, 20, 30, 31)] == [None] * 5
    s.observe([40], 1.0, token_ids=[7, 8], block_size=1)
    assert s.info[40].token_ids == (7,)


def test_observe_keeps_tokens_up_to_the_limit_and_only_of_a_whole_prefix() -> None:
    s = PrefixStats(keep_tokens_up_to=4)
    s.observe([10, 11, 12], 1.0, token_ids=list(range(6)), block_size=2)  # 2, 4 (at the limit), 6 tokens
    assert [s.info[k].token_ids for k in (10, 11, 12)] == [(0, 1), (0, 1, 2, 3), None]
    s = PrefixStats()
    s.observe([10, 11, 12, 13], 1.0, token_ids=list(range(5)), block_size=2)  # a prompt cut short
    assert [s.info[k].token_ids for k in (10, 11, 13)] == [(0, 1), (0, 1, 2, 3), None]


def test_observe_links_parents_counts_and_returns_the_keys_seen() -> None:
    s = PrefixStats()
    for t in (1.0, 2.0, 3.0):
        assert s.observe([10, 11, 12, 13], t) == [10, 11, 13]
    first, last = s.info[10], s.info[13]
    assert first.parent is None and s.info[11].parent == 10 and last.parent == 11
    assert (last.n_blocks, last.count, last.total, last.last_seen) == (4, 3, 3, 3.0)


def test_observe_keys_needs_one_key_per_checkpoint() -> None:
    with pytest.raises(ValueError):
        PrefixStats().observe_keys(4, [10, 11], 1.0)  # checkpoints 1, 2, 4: three keys


def test_new_keys_stop_at_max_keys_but_known_ones_are_still_counted() -> None:
    s = PrefixStats(max_keys=2)
    s.observe_keys(2, [10, 11], 1.0)
    assert s.observe_keys(4, [12, 11, 13], 2.0) == [11]  # 12 and 13 are new: no room; 11 is known
    assert set(s.info) == {10, 11} and s.info[11].count == 2


def test_max_events_keeps_exactly_that_many_observations() -> None:
    s = PrefixStats(max_events=3)
    for t in (1.0, 2.0, 3.0):
        s.observe([10], t)
    assert s.rate(10, 3.0) == 3
    s.observe([10], 4.0)
    assert s.rate(10, 4.0) == 3 and len(s.events) == 3
