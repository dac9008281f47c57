"""The router's index replica knows the medium: WatchIndex deltas (live and snapshot) carry the blocks a worker
holds only in a host tier, and the replica splits a match into the GPU run and the tier part with the
cache-manager's own function (`kvmesh.replica.media`): both answer the same at every step."""

from __future__ import annotations

import pytest

from kvmesh.cachemgr.core import CacheCore
from kvmesh.core.config import ServerSettings
from kvmesh.core.kvevents import AllBlocksCleared, BlockRemoved, BlockStored, KvEvent, KvEventBatch
from kvmesh.replica.media import gpu_run, split_matches
from kvmesh.services.cache_manager.servicer import entry_message, snapshot_messages
from kvmesh.services.router.index_replica import IndexReplica
from kvmesh.v1 import cache_manager_pb2 as pb

pytestmark = pytest.mark.unit
BS = 4
TOKS = tuple(range(3 * BS))
PROMPT = [*TOKS, 99]


class Mirror:
    """A CacheCore fed event batches, a watcher on it, and a replica applying the watcher's deltas."""

    def __init__(self) -> None:
        self.core = CacheCore(BS, "m")
        self.watcher, _, _ = self.core.watch(())
        self.replica = IndexReplica("", ServerSettings())
        self.replica.apply(pb.WatchIndexResponse(snapshot=True, snapshot_done=True))  # the (empty) snapshot
        self.seq = -1

    def feed(self, *events: KvEvent) -> None:
        self.seq += 1
        res = self.core.apply(KvEventBatch("w1", "i1", self.seq, float(self.seq), events))
        assert res.resync is None
        while not self.watcher.queue.empty():
            item = self.watcher.queue.get_nowait()
            assert item is not None
            self.replica.apply(entry_message(item))

    def core_split(self) -> tuple[int, int]:
        hashes = self.core.hashes_of(PROMPT)
        m = self.core.find_matches(hashes, 0.0)
        return m.get("w1", 0) - self.core.tier_blocks(hashes, m).get("w1", 0), m.get("w1", 0)


async def replica_split(replica: IndexReplica, core: CacheCore) -> tuple[int, int]:
    found = await replica.lookup(core.hashes_of(PROMPT))
    return found.gpu.get("w1", 0), found.total.get("w1", 0)


async def test_live_deltas_keep_the_replica_s_split_equal_to_the_cache_manager_s() -> None:
    mx = Mirror()
    steps: list[tuple[tuple[KvEvent, ...], tuple[int, int]]] = [
        ((BlockStored((1, 2, 3), None, TOKS, BS, medium="GPU"),), (3, 3)),
        ((BlockRemoved((2, 3), medium="GPU"), BlockStored((2, 3), 1, TOKS[BS:], BS, medium="CPU")), (1, 3)),
        ((BlockRemoved((2,), medium="CPU"), BlockStored((2,), 1, TOKS[BS : 2 * BS], BS, medium="GPU")), (2, 3)),
        ((BlockStored((3,), 2, TOKS[2 * BS :], BS, medium="GPU"),), (3, 3)),  # a GPU copy beside the CPU one
        ((BlockRemoved((3,), medium="GPU"),), (2, 3)),  # the CPU copy is left: tier-only again
        ((BlockRemoved((3,), medium="CPU"),), (2, 2)),  # gone
        ((BlockRemoved((2,), medium="GPU"), BlockStored((2,), 1, TOKS[BS : 2 * BS], BS, medium="CPU")), (1, 2)),
        ((AllBlocksCleared(),), (0, 0)),  # the engine's pool reset: block 1 goes, block 2's CPU copy stays
        ((BlockStored((1,), None, TOKS[:BS], BS, medium="GPU"),), (1, 2)),
        ((BlockRemoved((1,), medium="GPU"), BlockRemoved((2,), medium="CPU")), (0, 0)),
    ]
    for events, want in steps:
        mx.feed(*events)
        assert mx.core_split() == want
        assert await replica_split(mx.replica, mx.core) == want
    assert mx.replica.tier_pairs() == 0


async def test_a_snapshot_carries_the_tier_only_blocks() -> None:
    mx = Mirror()
    mx.feed(BlockStored((1,), None, TOKS[:BS], BS, medium="GPU"), BlockStored((2, 3), 1, TOKS[BS:], BS, medium="CPU"))
    _, rev, snap = mx.core.watch(())
    fresh = IndexReplica("", ServerSettings())
    msgs = snapshot_messages(snap, rev)
    assert msgs[-1].snapshot_done and all(m.snapshot for m in msgs)
    for m in msgs:
        fresh.apply(m)
    assert fresh.fresh
    assert await replica_split(fresh, mx.core) == mx.core_split() == (1, 3)


def test_the_shared_split_stops_at_the_first_tier_only_block() -> None:
    assert gpu_run([5, 6, 7, 8], 4, {7}) == 2
    assert gpu_run([5, 6, 7, 8], 2, {7}) == 2  # past the match: not counted
    assert gpu_run([5, 6, 7, 8], 4, set()) == 4
    assert split_matches([5, 6, 7], {"a": 3, "b": 1}, {"a": {5}}) == {"a": 0, "b": 1}
