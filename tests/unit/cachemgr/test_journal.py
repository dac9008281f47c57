"""Resumable WatchIndex: the journal of recent revisions, the stream's first messages (missed deltas only, or a
snapshot), the follower's copy (resume point, revision gaps) and the followed zones in a checkpoint."""

from __future__ import annotations

import asyncio
from typing import cast

import pytest

from kvmesh.cachemgr.checkpoint import restore_state, snapshot_state
from kvmesh.cachemgr.core import CacheCore
from kvmesh.cachemgr.journal import DeltaJournal, Entry
from kvmesh.core.kvevents import BlockStored, KvEventBatch
from kvmesh.index.types import Stored
from kvmesh.replica.follower import IndexFollower, RevisionGap
from kvmesh.replica.index import ReplicaIndex
from kvmesh.rpc.channel import PLAINTEXT
from kvmesh.services.cache_manager.servicer import CacheManagerServicer, entry_message
from kvmesh.services.cache_manager.warming import Warmer
from kvmesh.store.file import FileCheckpointStore
from kvmesh.v1 import cache_manager_pb2 as pb
from kvmesh.wire import ingest_log as codec

pytestmark = pytest.mark.unit
BS = 4
TOKENS = list(range(64 * BS))


def entry(r: int) -> Entry:
    return Entry(r, float(r), (Stored("w", None, (r,)),))


def test_the_journal_tells_the_revisions_after_a_point_it_still_holds() -> None:
    j = DeltaJournal(4, "e1")
    for r in range(1, 11):
        j.append(entry(r))
    assert (j.base, j.last, len(j)) == (6, 10, 4)
    assert [e.revision for e in j.since("e1", 6) or []] == [7, 8, 9, 10]
    assert j.since("e1", 10) == []
    assert j.since("e1", 5) is None  # revision 6 is gone
    assert j.since("e1", 11) is None  # ahead of it
    assert j.since("e0", 8) is None  # another epoch's numbering
    with pytest.raises(ValueError, match="does not follow"):
        j.append(entry(12))
    j.reset("e2", 10)
    assert j.since("e1", 10) is None and j.since("e2", 10) == []


class Zone:
    """A cache-manager core fed one new block per batch (one revision each) and its WatchIndex servicer."""

    def __init__(self, journal: int = 8) -> None:
        self.core = CacheCore(BS, "m", journal_revisions=journal)
        self.servicer = CacheManagerServicer(self.core, cast(Warmer, None), asyncio.Event(), "")
        self.seq = 0

    def publish(self, n: int) -> None:
        for _ in range(n):
            i = self.seq
            toks = tuple(TOKENS[i * BS : (i + 1) * BS])
            ev = BlockStored((100 + i,), 100 + i - 1 if i else None, toks, BS)
            assert self.core.apply(KvEventBatch("w1", "i1", i, float(i), (ev,))).resync is None
            self.seq += 1

    def start(self, revision: int = 0, epoch: str = "") -> list[pb.WatchIndexResponse]:
        """The first messages of a stream from that resume point (its watcher is removed again)."""
        req = pb.WatchIndexRequest(resume_revision=revision, resume_epoch=epoch)
        watcher, msgs = self.servicer._start_watch(req)
        self.core.fanout.remove(watcher)
        return msgs

    def matches(self, replica: ReplicaIndex) -> dict[str, int]:
        return replica.index.find_matches(self.core.hashes_of(TOKENS))


def test_a_resume_inside_the_journal_sends_only_the_missed_deltas() -> None:
    z = Zone()
    z.publish(3)
    copy = ReplicaIndex()
    for msg in z.start():
        copy.apply(msg)
    assert copy.complete and (copy.revision, copy.epoch) == (3, z.core.journal.epoch)
    copy.interrupted()
    z.publish(5)  # missed while the link was down
    msgs = z.start(copy.revision, copy.epoch)
    assert msgs[0].resumed and not msgs[0].snapshot and msgs[0].revision == 3 and not msgs[0].deltas
    assert [m.revision for m in msgs[1:]] == [4, 5, 6, 7, 8] and all(len(m.deltas) == 1 for m in msgs[1:])
    assert all(m.ingested_at > 0 for m in msgs[1:])
    for msg in msgs:
        copy.apply(msg)
    assert copy.complete and copy.revision == 8
    assert z.matches(copy) == z.core.index.find_matches(z.core.hashes_of(TOKENS)) == {"w1": 8}


@pytest.mark.parametrize("why", ["older than the journal", "another epoch", "a restored cache-manager"])
async def test_a_resume_the_journal_cannot_serve_gets_a_snapshot(why: str, tmp_path: object) -> None:
    z = Zone(journal=4)
    z.publish(2)
    epoch = z.core.journal.epoch
    if why == "older than the journal":
        z.publish(5)  # revision 3 is gone from a 4-revision journal at 7
    elif why == "another epoch":
        epoch = "not-" + epoch
    else:
        z.core.store = FileCheckpointStore(str(tmp_path))
        await z.core.checkpoint()
        await z.core.restore()  # same revision, new numbering
        assert z.core.revision == 2 and z.core.journal.epoch != epoch
    msgs = z.start(2, epoch)
    assert msgs[0].snapshot and not msgs[0].resumed and msgs[-1].snapshot_done
    assert msgs[0].epoch == z.core.journal.epoch
    copy = ReplicaIndex()
    for msg in msgs:
        copy.apply(msg)
    assert z.matches(copy) == {"w1": z.seq}


def test_a_half_applied_snapshot_is_no_resume_point() -> None:
    z = Zone()
    z.publish(1)
    copy = ReplicaIndex()
    copy.apply(pb.WatchIndexResponse(deltas=[pb.IndexDelta(worker_id="w1", cleared=True)], snapshot=True, revision=1))
    copy.interrupted()
    assert copy.epoch == "" and not copy.complete  # the next stream asks for a snapshot


def test_the_follower_reopens_on_a_revision_gap() -> None:
    z = Zone()
    z.publish(2)
    f = IndexFollower("", PLAINTEXT)
    msgs = z.start()
    for i, msg in enumerate(msgs):
        f.apply(msg, first=i == 0)
    assert f.connected and f.snapshots == 1 and f.request().resume_revision == 2
    f.apply(entry_message(Entry(3, 1.0, (Stored("w1", None, (7,)),))), first=False)
    with pytest.raises(RevisionGap, match="revision 5 after 3"):
        f.apply(entry_message(Entry(5, 1.0, (Stored("w1", None, (8,)),))), first=False)


def test_followed_zones_travel_in_the_checkpoint_and_old_checkpoints_load() -> None:
    z = Zone()
    z.publish(4)
    copy = ReplicaIndex()
    for msg in z.start():
        copy.apply(msg)
    core = CacheCore(BS, "m", zones=["a"])
    data = snapshot_state(core.index, core.ingestor, core.stats, {}, {"a": copy})
    back = ReplicaIndex()
    back.load(restore_state(data, core.hasher).zones["a"])
    assert z.matches(back) == {"w1": 4} and (back.revision, back.epoch) == (copy.revision, copy.epoch)
    assert not back.complete
    old = codec.decode(data)
    del old["zones"]  # a checkpoint written before zones were followed
    assert restore_state(codec.encode(old), core.hasher).zones == {}
