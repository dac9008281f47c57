"""The load history's edges (kvmesh.ops.planner.history): its checkpoint's fields and bounds, and the buckets it
keeps."""

from __future__ import annotations

import pytest

from kvmesh.ops.planner.history import LoadHistory


def test_a_history_that_has_observed_nothing_round_trips_through_its_checkpoint() -> None:
    fresh = LoadHistory(bucket_s=60.0)
    back = LoadHistory.from_json(fresh.to_json())
    assert (back.start_s, back.counts, back.last_totals, back.bucket_s) == (None, [], {}, 60.0)
    assert back.completed(1e9).size == 0 and back.start_bucket == 0


def test_a_checkpoint_with_counts_but_no_start_is_refused_naming_the_field() -> None:
    # counts without the time of their first bucket cannot be placed: refused like any other bad field, whether
    # or not they exceed `max_buckets` (they did end in an AssertionError in the trim)
    for n in (2, 5):
        with pytest.raises(ValueError, match=r"^planner history checkpoint: start_s is null but counts are not empty"):
            LoadHistory.from_json({"bucket_s": 60.0, "start_s": None, "counts": [1.0] * n, "totals": {}}, max_buckets=3)


def test_bucket_s_below_one_second_is_a_valid_checkpoint() -> None:
    h = LoadHistory.from_json({"bucket_s": 0.5, "start_s": 10.0, "counts": [3.0], "totals": {"w": 3.0}})
    assert h.bucket_s == 0.5 and h.completed(10.5).tolist() == [3.0]
    for bad in (0.0, -1.0):
        with pytest.raises(ValueError, match=r"^planner history checkpoint: bucket_s must be > 0$"):
            LoadHistory.from_json({"bucket_s": bad, "start_s": 0.0, "counts": [], "totals": {}})


def test_a_checkpoint_of_exactly_max_buckets_is_kept_whole() -> None:
    h = LoadHistory.from_json({"bucket_s": 10.0, "start_s": 100.0, "counts": [1.0, 2.0, 3.0], "totals": {}}, 3)
    assert (h.counts, h.start_s) == ([1.0, 2.0, 3.0], 100.0)
    cut = LoadHistory.from_json({"bucket_s": 10.0, "start_s": 100.0, "counts": [1.0, 2.0, 3.0], "totals": {}}, 2)
    assert (cut.counts, cut.start_s) == ([2.0, 3.0], 110.0)  # the oldest dropped, the start moved past it


def test_a_history_kept_to_no_buckets_restores_an_empty_checkpoint() -> None:
    # max_buckets = 0 keeps nothing: an unstarted history is already within it and loads as it is
    back = LoadHistory.from_json(LoadHistory(bucket_s=60.0).to_json(), max_buckets=0)
    assert (back.start_s, back.counts) == (None, [])


def test_a_worker_whose_counter_did_not_move_adds_nothing() -> None:
    h = LoadHistory(bucket_s=10.0)
    h.observe(0.0, {"w": 40.0})
    h.observe(5.0, {"w": 40.0})
    h.observe(12.0, {"w": 40.0})
    assert h.completed(20.0).tolist() == [0.0, 0.0]


def test_observations_in_one_bucket_add_up_and_skipped_buckets_are_empty() -> None:
    h = LoadHistory(bucket_s=10.0)
    h.observe(0.0, {"w": 0.0})
    h.observe(3.0, {"w": 5.0})
    h.observe(6.0, {"w": 12.0})  # the same bucket: 5 + 7
    h.observe(35.0, {"w": 13.0})  # buckets 1 and 2 saw no observation
    assert h.completed(40.0).tolist() == [12.0, 0.0, 0.0, 1.0]
    assert len(h.counts) == 4
