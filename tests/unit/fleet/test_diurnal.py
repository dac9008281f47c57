"""A day from a one-hour trace (kvmesh.fleet.diurnal)."""

from __future__ import annotations

import numpy as np
import pytest

from kvmesh.fleet.diurnal import DayShape, arrival_counts, repeat_hour
from kvmesh.fleet.trace import Trace, TraceRequest


def _hour(n: int = 2000) -> Trace:
    return Trace("h", [TraceRequest(i, i * 3600.0 / n, 600, 4, (i % 50, 7)) for i in range(n)])


def test_each_copy_keeps_about_its_fraction_and_overlays_whole_copies_above_one() -> None:
    day = repeat_hour(_hour(), [0.25, 1.0, 2.5], seed=0)
    counts = arrival_counts(day, 3600.0, 3)
    assert counts[1] == 2000
    assert abs(counts[0] - 500) < 80
    assert abs(counts[2] - 5000) < 80
    assert [r.index for r in day.requests] == list(range(len(day)))
    assert all(a.arrival_s <= b.arrival_s for a, b in zip(day.requests, day.requests[1:], strict=False))


def test_copies_share_no_chunk_so_reuse_stays_within_an_hour() -> None:
    day = repeat_hour(_hour(), [1.0, 1.0], seed=0)
    first = {c for r in day.requests if r.arrival_s < 3600 for c in r.chunks}
    second = {c for r in day.requests if r.arrival_s >= 3600 for c in r.chunks}
    assert not first & second
    assert max(second) < 2**54  # token expansion never wraps


def test_the_day_is_deterministic_and_shaped() -> None:
    shape = DayShape(trough=0.25, peak_hour=14.0, noise_sigma=0.0)
    m = shape.multipliers(2, seed=0)
    assert m.shape == (2, 24)
    assert m[0, 14] == pytest.approx(1.0) and m[0, 2] == pytest.approx(0.25)
    noisy = DayShape(noise_sigma=0.1)
    np.testing.assert_array_equal(noisy.multipliers(2, 3), noisy.multipliers(2, 3))
    assert not np.array_equal(noisy.multipliers(2, 3)[0], noisy.multipliers(2, 3)[1])
    a = repeat_hour(_hour(), [0.5], seed=1)
    b = repeat_hour(_hour(), [0.5], seed=1)
    assert [r.arrival_s for r in a.requests] == [r.arrival_s for r in b.requests]
    with pytest.raises(ValueError, match="not >= 0"):
        repeat_hour(_hour(), [-0.1], seed=0)
