"""`IngestResult.merge` (`kvmesh.index.types`), which the cache-manager's servicer uses to fold a dump's or a
replay's outcome into the batch's: lists appended in order, a later resync request replacing an earlier one (and
none leaving it), the gap and restart flags set when either side has them."""

from __future__ import annotations

import pytest

from kvmesh.index.types import Cleared, IngestResult, Removed, ResyncRequest, Stored

pytestmark = pytest.mark.unit

EARLY = ResyncRequest("w", "i0", 3, False, "gap")
LATE = ResyncRequest("w", "i1", 0, True, "restart")


def test_merge_appends_every_list_in_order() -> None:
    first = IngestResult(
        applied=[1, 2], ignored=[(0, "old")], buffered=[7], deltas=[Stored("w", None, (1,))], resync=EARLY
    )
    second = IngestResult(applied=[3], ignored=[(9, "dup")], buffered=[8, 9], deltas=[Removed("w", (1,)), Cleared("w")])
    first.merge(second)
    assert first.applied == [1, 2, 3]
    assert first.ignored == [(0, "old"), (9, "dup")]
    assert first.buffered == [7, 8, 9]
    assert first.deltas == [Stored("w", None, (1,)), Removed("w", (1,)), Cleared("w")]
    assert second == IngestResult(
        applied=[3], ignored=[(9, "dup")], buffered=[8, 9], deltas=[Removed("w", (1,)), Cleared("w")]
    )


@pytest.mark.parametrize(
    ("mine", "theirs", "kept"), [(None, None, None), (EARLY, None, EARLY), (None, LATE, LATE), (EARLY, LATE, LATE)]
)
def test_a_later_resync_request_replaces_an_earlier_one(
    mine: ResyncRequest | None, theirs: ResyncRequest | None, kept: ResyncRequest | None
) -> None:
    result = IngestResult(resync=mine)
    result.merge(IngestResult(resync=theirs))
    assert result.resync is kept


@pytest.mark.parametrize("mine", [False, True])
@pytest.mark.parametrize("theirs", [False, True])
def test_gap_and_restart_are_set_when_either_side_has_them(mine: bool, theirs: bool) -> None:
    result = IngestResult(gap=mine, restart=mine)
    result.merge(IngestResult(gap=theirs, restart=theirs))
    assert result.gap is (mine or theirs)
    assert result.restart is (mine or theirs)
    crossed = IngestResult(gap=mine, restart=not mine)
    crossed.merge(IngestResult(gap=theirs, restart=not theirs))
    assert crossed.gap is (mine or theirs) and crossed.restart is ((not mine) or (not theirs))


def test_an_empty_result_merges_to_the_same() -> None:
    result = IngestResult(applied=[1], gap=True)
    result.merge(IngestResult())
    assert result == IngestResult(applied=[1], gap=True)
