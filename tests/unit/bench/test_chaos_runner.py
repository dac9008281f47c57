"""The chaos final pass's index reference: a worker's full dump ingested as the cache-manager would."""

from __future__ import annotations

from kvmesh.bench.chaos_runner import indexed_from_dump
from kvmesh.cachemgr.hasher import IndexHasher
from kvmesh.core.kvevents import BlockStored

BS = 4
MODEL = "chaos-model"


def block(h: int, parent: int | None, first_token: int) -> BlockStored:
    return BlockStored((h,), parent, tuple(range(first_token, first_token + BS)), BS)


def test_a_dump_gives_the_index_hashes_of_its_chains_and_names_its_orphans() -> None:
    # 1 -> 2 -> 3 chained; 5's parent 4 was evicted, so 5 and its child 6 are orphans
    dump = [block(1, None, 0), block(2, 1, 4), block(5, 4, 12), block(3, 2, 8), block(6, 5, 16)]
    got = indexed_from_dump("w0", dump, BS, MODEL)
    assert got.indexed == set(IndexHasher(MODEL).chain(None, list(range(12)), BS, None))
    assert got.orphans == {5, 6}
