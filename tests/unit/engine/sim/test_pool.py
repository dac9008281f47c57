"""BlockPool: prefix caching, LRU eviction order, and an event log that replays to the cached set."""

from __future__ import annotations

import pytest

from kvmesh.core.kvevents import AllBlocksCleared, BlockRemoved, BlockStored, KvEvent
from kvmesh.engine.sim.pool import BlockPool

pytestmark = pytest.mark.unit


def replay(events: list[KvEvent], into: set[int] | None = None) -> set[int]:
    s = set() if into is None else into
    for e in events:
        if isinstance(e, BlockStored):
            s.update(e.block_hashes)
        elif isinstance(e, BlockRemoved):
            for h in e.block_hashes:
                s.remove(h)  # removing an unknown hash would be an index corruption
        elif isinstance(e, AllBlocksCleared):
            s.clear()
    return s


def fill(pool: BlockPool, hashes: list[int], parent: int | None = None) -> list[int]:
    ids = pool.allocate(len(hashes))
    toks = [t for h in hashes for t in [h] * pool.block_size]
    pool.cache_full_blocks(ids, hashes, toks, 0, parent)
    return ids


def test_store_match_release_and_lru_eviction() -> None:
    pool = BlockPool(num_blocks=6, block_size=4)
    a = fill(pool, [11, 12, 13])
    b = fill(pool, [21, 22])
    ev = pool.drain_events()
    assert [type(e) for e in ev] == [BlockStored, BlockStored]
    first = ev[0]
    assert isinstance(first, BlockStored)
    assert first.token_ids == (11,) * 4 + (12,) * 4 + (13,) * 4
    assert pool.num_used == 5 and pool.num_cached == 5
    pool.release(a)  # a released first: least recently used
    pool.release(b)
    assert pool.num_used == 0 and pool.match_prefix([11, 12, 99]) == a[:2]
    # 1 never-used block goes first, then a's chain tail-first (13, 12), leaving 11 and b cached
    pool.allocate(3)
    removed = pool.drain_events()
    assert removed == [BlockRemoved(block_hashes=(13, 12))]
    assert pool.cached_hashes() == {11, 21, 22}


def test_touch_protects_from_eviction_and_refreshes_lru() -> None:
    pool = BlockPool(num_blocks=4, block_size=2)
    a = fill(pool, [1, 2])
    b = fill(pool, [3, 4])
    pool.release(a)
    pool.release(b)
    pool.touch(a)  # a prefix hit: referenced, out of the free queue
    pool.release(a)  # now most recently used
    pool.allocate(2)
    assert pool.drain_events()[-1] == BlockRemoved(block_hashes=(4, 3))
    assert pool.cached_hashes() == {1, 2}


def test_duplicate_hash_is_not_cached_twice() -> None:
    pool = BlockPool(num_blocks=4, block_size=2)
    fill(pool, [7, 8])
    ids = pool.allocate(2)
    pool.cache_full_blocks(ids, [7, 9], [7, 7, 9, 9], 0, None)
    ev = pool.drain_events()
    assert ev[-1] == BlockStored(block_hashes=(9,), parent_block_hash=7, token_ids=(9, 9), block_size=2)
    pool.release(ids)
    assert pool.num_free == 2 and pool.cached_hashes() == {7, 8, 9}
    pool.allocate(1)  # the uncached duplicate of 7 sits at the front: reused without an eviction
    assert pool.drain_events() == [] and pool.cached_hashes() == {7, 8, 9}


def test_double_release_is_an_error_and_allocation_beyond_capacity_fails() -> None:
    pool = BlockPool(num_blocks=2, block_size=2)
    ids = pool.allocate(2)
    with pytest.raises(MemoryError):
        pool.allocate(1)
    pool.release(ids)
    with pytest.raises(ValueError):
        pool.release(ids)


def test_reset_and_dump() -> None:
    pool = BlockPool(num_blocks=8, block_size=2)
    a = fill(pool, [1, 2, 3])
    assert not pool.reset_prefix_cache()  # blocks referenced
    dump = pool.dump()
    assert [d.block_hashes for d in dump] == [(1,), (2,), (3,)]
    assert [d.parent_block_hash for d in dump] == [None, 1, 2]
    pool.release(a)
    assert pool.reset_prefix_cache()
    assert pool.drain_events()[-1] == AllBlocksCleared() and pool.num_cached == 0
