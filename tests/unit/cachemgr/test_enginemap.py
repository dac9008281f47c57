"""`EngineHashMap`: a worker's engine → index hash map stays bounded under eviction churn (its tombstones are a
FIFO of `tomb_capacity`), while a just-evicted parent still chains."""

from __future__ import annotations

from kvmesh.cachemgr.enginemap import EngineHashMap


def test_tombstones_stay_bounded_under_a_long_churn_and_the_newest_still_chain() -> None:
    pool, cap, stores = 64, 256, 10_000  # a small engine pool evicting its oldest block at every store
    m = EngineHashMap(tomb_capacity=cap)
    for i in range(stores):
        assert m.add(i, i + 1_000_000) is True
        if i >= pool:
            assert m.drop(i - pool) == i - pool + 1_000_000
        assert len(m.live) <= pool and len(m.tomb) <= cap
    assert (len(m.live), len(m.tomb), len(m.extra)) == (pool, cap, 0)
    newest_gone = stores - pool - 1
    assert m.parent(newest_gone) == newest_gone + 1_000_000  # a child of a just-evicted block still chains
    assert m.parent(newest_gone - cap + 1) is not None  # the oldest tombstone kept
    assert m.parent(newest_gone - cap) is None  # and the one before it went first


def test_a_re_stored_block_leaves_the_tombstones() -> None:
    m = EngineHashMap(tomb_capacity=4)
    m.add(1, 11)
    assert m.drop(1) == 11 and m.tomb == {1: 11}
    assert m.add(1, 11) is True and not m.tomb  # live again: one entry, not two
