"""`kvmesh.bench balance` helpers: the prompts share no block; percentiles are nearest-rank."""

from __future__ import annotations

import pytest

from kvmesh.bench.balance import distinct_prompts, percentile

pytestmark = pytest.mark.unit


def test_prompts_are_distinct_from_their_first_block_and_in_the_vocabulary() -> None:
    ps = distinct_prompts(64, 512, seed=0)
    assert len(ps) == 64 and all(len(p) == 512 for p in ps)
    assert len({tuple(p[:32]) for p in ps}) == 64  # no two share even their first 32-token block
    assert all(3 <= t < 1000 for p in ps for t in p)


def test_percentile_is_nearest_rank() -> None:
    xs = [float(i) for i in range(1, 101)]
    assert percentile(xs, 0.5) == 51.0 and percentile(xs, 0.99) == 100.0 and percentile([7.0], 0.99) == 7.0
