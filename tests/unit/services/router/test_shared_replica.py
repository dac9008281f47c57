"""The index replica the router processes of a host share (`kvmesh.replica.shared`): a reader answers
each lookup as the writer and the cache-manager do, tier split included, and answers nothing it cannot vouch
for (copy incomplete, writer silent), so that the router asks the cache-manager instead."""

from __future__ import annotations

import time
import uuid
from collections.abc import Iterator

import pytest

from kvmesh.cachemgr.core import CacheCore
from kvmesh.core.config import ServerSettings
from kvmesh.core.kvevents import AllBlocksCleared, BlockRemoved, BlockStored, KvEvent, KvEventBatch
from kvmesh.index import NATIVE
from kvmesh.index.shared import remove_files
from kvmesh.replica.shared import STALE_S, SharedReplicaIndex, SharedReplicaView
from kvmesh.services.cache_manager.servicer import entry_message
from kvmesh.services.router.index_replica import IndexReplica
from kvmesh.v1 import cache_manager_pb2 as pb

pytestmark = [pytest.mark.unit, pytest.mark.skipif(not NATIVE, reason="the shared index is the compiled one")]
BS = 4
TOKS = tuple(range(3 * BS))
PROMPT = [*TOKS, 99]


@pytest.fixture
def path() -> Iterator[str]:
    p = f"/dev/shm/kvmesh-test-{uuid.uuid4().hex[:12]}"
    yield p
    remove_files(p)


class Host:
    """A CacheCore fed event batches; a writer replica applying its watcher's deltas; a reader of the writer."""

    def __init__(self, path: str) -> None:
        self.core = CacheCore(BS, "m")
        self.watcher, _, _ = self.core.watch(())
        self.writer = IndexReplica("", ServerSettings(), shared_index=path, shared_role="writer")
        self.reader = IndexReplica("", ServerSettings(), shared_index=path, shared_role="reader")
        self.copy = self.writer.follower.replica
        assert isinstance(self.copy, SharedReplicaIndex) and self.reader.view is not None
        self.view: SharedReplicaView = self.reader.view
        self.seq = -1

    def snapshot(self) -> None:
        self.writer.apply(pb.WatchIndexResponse(snapshot=True, snapshot_done=True))  # the (empty) snapshot
        self.copy.beat(time.monotonic_ns())
        assert self.view.refresh()

    def feed(self, *events: KvEvent) -> None:
        self.seq += 1
        assert self.core.apply(KvEventBatch("w1", "i1", self.seq, float(self.seq), events)).resync is None
        while not self.watcher.queue.empty():
            item = self.watcher.queue.get_nowait()
            assert item is not None
            self.writer.apply(entry_message(item))

    def core_split(self) -> tuple[int, int]:
        hashes = self.core.hashes_of(PROMPT)
        m = self.core.find_matches(hashes, 0.0)
        return m.get("w1", 0) - self.core.tier_blocks(hashes, m).get("w1", 0), m.get("w1", 0)


async def split(replica: IndexReplica, core: CacheCore) -> tuple[int, int]:
    found = await replica.lookup(core.hashes_of(PROMPT))
    return found.gpu.get("w1", 0), found.total.get("w1", 0)


async def test_a_reader_answers_as_the_writer_and_the_cache_manager_at_every_step(path: str) -> None:
    host = Host(path)
    host.snapshot()
    steps: list[tuple[tuple[KvEvent, ...], tuple[int, int]]] = [
        ((BlockStored((1, 2, 3), None, TOKS, BS, medium="GPU"),), (3, 3)),
        ((BlockRemoved((2, 3), medium="GPU"), BlockStored((2, 3), 1, TOKS[BS:], BS, medium="CPU")), (1, 3)),
        ((BlockRemoved((2,), medium="CPU"), BlockStored((2,), 1, TOKS[BS : 2 * BS], BS, medium="GPU")), (2, 3)),
        ((BlockRemoved((3,), medium="CPU"),), (2, 2)),
        ((BlockRemoved((2,), medium="GPU"), BlockStored((2,), 1, TOKS[BS : 2 * BS], BS, medium="CPU")), (1, 2)),
        ((AllBlocksCleared(),), (0, 0)),  # block 1 goes, block 2's CPU copy stays
        ((BlockStored((1,), None, TOKS[:BS], BS, medium="GPU"),), (1, 2)),
    ]
    for events, want in steps:
        host.feed(*events)
        assert host.core_split() == want
        assert await split(host.writer, host.core) == want
        assert await split(host.reader, host.core) == want
    assert host.reader.tier_pairs() == host.writer.tier_pairs() == 1
    assert host.reader.revision == host.writer.revision == len(steps)


async def test_a_reader_answers_nothing_it_cannot_vouch_for(path: str) -> None:
    host = Host(path)
    hashes = host.core.hashes_of(PROMPT)
    now = time.monotonic_ns()
    assert not host.view.refresh() or host.view.lookup(hashes, now) is None  # the writer's copy: no snapshot yet
    host.snapshot()
    host.feed(BlockStored((1, 2, 3), None, TOKS, BS, medium="GPU"))
    now = time.monotonic_ns()
    found = host.view.lookup(hashes, now)
    assert found is not None and found.total == {"w1": 3}
    assert host.view.lookup(hashes, now + int(STALE_S * 1e9)) is None  # the writer has been silent too long
    host.copy.interrupted()  # its stream broke: not complete until the next snapshot or resume
    assert host.view.lookup(hashes, now) is None and not host.reader.fresh
    assert await split(host.reader, host.core) == (0, 0)  # no cache-manager to ask here: no overlap


def test_a_reader_knows_when_the_writer_found_the_cache_manager_disagreeing(path: str) -> None:
    host = Host(path)
    host.snapshot()
    assert host.reader.disagreement == ""
    host.copy.beat(time.monotonic_ns(), disagrees=True)
    assert "disagrees" in host.reader.disagreement  # so it does not ask that cache-manager (FindMatches) either
    host.copy.beat(time.monotonic_ns())
    assert host.reader.disagreement == ""


async def test_a_reset_writer_is_read_as_empty_not_as_its_old_copy(path: str) -> None:
    host = Host(path)
    host.snapshot()
    host.feed(BlockStored((1, 2, 3), None, TOKS, BS, medium="GPU"))
    hashes = host.core.hashes_of(PROMPT)
    assert host.view.lookup(hashes, time.monotonic_ns()) is not None
    host.copy.reset()  # e.g. the router follows another cache-manager: a snapshot comes
    assert host.view.lookup(hashes, time.monotonic_ns()) is None
    host.writer.apply(pb.WatchIndexResponse(snapshot=True, snapshot_done=True, revision=9))
    found = host.view.lookup(hashes, time.monotonic_ns())
    assert found is not None and found.total == {}


def test_a_shared_replica_is_not_checkpointed(path: str) -> None:
    copy = SharedReplicaIndex(path)
    with pytest.raises(TypeError, match="not checkpointed"):
        copy.export()
    with pytest.raises(TypeError, match="rebuilt from its stream"):
        copy.load(None)


def test_role_and_path_go_together() -> None:
    with pytest.raises(ValueError, match="go together"):
        IndexReplica("", ServerSettings(), shared_index="/dev/shm/x")
