"""Hot-prefix replication decisions (`kvmesh.ops.warming.replicate`): value order, the byte budget, what is skipped."""

from __future__ import annotations

import pytest

from kvmesh.ops.warming.replicate import ByteBudget, Candidate, candidates, plan_round, unfinished
from kvmesh.ops.warming.stats import PrefixStats

BS, BB = 16, 1000  # tokens and bytes per block


def cand(key: int, n_blocks: int, hits: int) -> Candidate:
    return Candidate(key, tuple(range(n_blocks * BS)), None, n_blocks, hits)


def test_value_is_hits_times_tokens_and_orders_the_round() -> None:
    cs = [cand(1, 2, 10), cand(2, 8, 3), cand(3, 4, 5)]  # values 320, 384, 320
    assert [c.value(BS) for c in cs] == [320, 384, 320]
    plan = plan_round(cs, set(), allowance=1e9, block_size=BS, block_bytes=BB, max_prefixes=10)
    assert [c.key for c in plan] == [2, 3, 1]  # equal values: the longer prefix first


def test_the_allowance_bounds_the_bytes_and_a_smaller_prefix_still_fits() -> None:
    cs = [cand(1, 8, 10), cand(2, 6, 10), cand(3, 2, 10)]  # 8000, 6000, 2000 bytes
    plan = plan_round(cs, set(), allowance=10_000, block_size=BS, block_bytes=BB, max_prefixes=10)
    assert [c.key for c in plan] == [1, 3]  # 6000 does not fit after 8000; 2000 does
    assert sum(c.n_blocks * BB for c in plan) <= 10_000


def test_replicated_prefixes_are_not_sent_again_and_the_count_is_capped() -> None:
    cs = [cand(k, 1, 10 - k) for k in range(6)]
    plan = plan_round(cs, {0, 1}, allowance=1e9, block_size=BS, block_bytes=BB, max_prefixes=3)
    assert [c.key for c in plan] == [2, 3, 4]


def test_the_byte_budget_refills_at_its_rate_up_to_its_burst() -> None:
    b = ByteBudget(rate=1000.0, burst=2000.0, now=0.0)
    assert b.available(0.0) == 2000.0
    b.spend(1800.0)
    assert b.available(1.0) == pytest.approx(1200.0)
    assert b.available(100.0) == 2000.0  # never more than the burst
    b.spend(2000.0)
    assert b.available(100.5) == pytest.approx(500.0)
    with pytest.raises(ValueError):
        ByteBudget(rate=0.0, burst=1.0, now=0.0)


def test_over_a_long_run_the_rounds_send_at_most_the_rate() -> None:
    b = ByteBudget(rate=3000.0, burst=6000.0, now=0.0)
    sent = 0.0
    for i in range(1, 101):  # 100 rounds, 0.5 s apart, always more to send than fits
        cs = [cand(1000 * i + k, 2, 5) for k in range(10)]
        plan = plan_round(cs, set(), b.available(i * 0.5), BS, BB, max_prefixes=64)
        cost = sum(c.n_blocks * BB for c in plan)
        b.spend(cost)
        sent += cost
    assert sent <= 6000.0 + 3000.0 * 50.0


def test_candidates_are_the_hot_prefixes_whose_tokens_are_known() -> None:
    stats = PrefixStats(window_s=60.0)
    known = list(range(4 * BS))
    for _ in range(3):
        stats.observe([11, 12, 13, 14], 1.0, token_ids=known, block_size=BS)
        stats.observe([21, 22], 1.0)  # no tokens: cannot be replicated
    cs = candidates(stats.hot(2.0, 3))
    assert [(c.key, c.n_blocks, c.hits, len(c.token_ids)) for c in cs] == [(14, 4, 3, 4 * BS)]


def test_replication_is_unfinished_while_a_prefix_that_could_go_is_not_there() -> None:
    cs = [cand(1, 2, 10), cand(2, 8, 3)]  # 2000 and 8000 bytes
    everywhere = lambda c: True  # noqa: E731
    assert unfinished(cs, {1}, BB, burst=10_000, held_here=everywhere)  # 2 is missing and fits
    assert not unfinished(cs, {1, 2}, BB, burst=10_000, held_here=everywhere)
    assert not unfinished(cs, {1}, BB, burst=5_000, held_here=everywhere)  # 2 can never fit: not waited for
    assert not unfinished(cs, {1}, BB, burst=10_000, held_here=lambda c: c.key != 2)  # no longer held here
    assert not unfinished(cs, set(), 0, burst=10_000, held_here=everywhere)  # no tier here: nothing can go
    assert not unfinished([], set(), BB, burst=10_000, held_here=everywhere)
