"""A worker's new instance (a restarted worker, or a fresh suite's worker named like one a restored checkpoint
knows) starts with a dump, so its first sync counts no gap and no resync: the hello's ack tells it 0, not the
earlier instance's next sequence. A real cache-manager process; the worker's side of PublishKvEvents as a kvmesh
worker's pusher plays it (`services/worker/pusher.py`: a dump when told 0, else a replay from there)."""

from __future__ import annotations

from collections.abc import Callable

import grpc
import pytest

from kvmesh.cachemgr.hasher import IndexHasher
from kvmesh.v1 import cache_manager_pb2 as pb
from kvmesh.v1 import cache_manager_pb2_grpc
from tests.integration.cache_manager.test_grpc import MODEL, Publisher, index_via_watch, start_cm
from tests.support.procs import ServiceProcess
from tests.unit.cachemgr.test_ingest_state import ToyEngine

pytestmark = pytest.mark.integration


async def _first_sync(pub: Publisher) -> pb.PublishKvEventsResponse:
    """Hello, then what a kvmesh worker's pusher does with the ack: a dump when told 0; else a replay of its log
    from the sequence it is told (a new instance's log holds nothing before its first batch: nothing to send)."""
    ack = await pub.hello()
    if ack.next_sequence == 0 or ack.resync_required:
        return await pub.dump()
    return ack


async def test_a_new_instance_of_a_known_worker_syncs_without_a_gap(services: Callable[..., ServiceProcess]) -> None:
    """The earlier instance synced and published nothing more (a worker no request reached): the index expects
    its batch 1. Told that 1, the new instance would replay nothing and send its own batch 1, which, being another
    instance's, restarts the worker's state at 0: a gap and a full resync on the very first request."""
    cm = start_cm(services)
    hasher = IndexHasher(MODEL)
    async with grpc.aio.insecure_channel(cm.address) as ch:
        stub = cache_manager_pb2_grpc.CacheManagerServiceStub(ch)
        old = ToyEngine("w0", hasher, seed=1, instance="run-1")
        old.seq = 1  # a kvmesh worker's log numbers its batches from 1
        pub = Publisher(stub, old)
        assert (await _first_sync(pub)).next_sequence == 1
        await pub.close()

        new = ToyEngine("w0", hasher, seed=2, instance="run-2")  # same worker id, a new engine
        new.seq = 1
        pub = Publisher(stub, new)
        hello = await pub.hello()
        assert hello.next_sequence == 0 and not hello.resync_required  # not run-1's 1: run-2 sent nothing yet
        ack = await pub.dump()
        assert ack.next_sequence == 1 and not ack.resync_required
        ack = await pub.live(new.prompt(list(range(100, 196))))
        assert ack.next_sequence == 2 and not ack.resync_required, ack
        await pub.close()

        again = ToyEngine("w0", hasher, seed=3, instance="run-3")  # and the pusher's own way, start to end
        again.seq = 1
        pub = Publisher(stub, again)
        await _first_sync(pub)
        ack = await pub.live(again.prompt(list(range(300, 364))))
        assert ack.next_sequence == 2 and not ack.resync_required, ack
        await pub.close()

        stats = await stub.GetStats(pb.GetStatsRequest())
        assert (stats.gaps_total, stats.resyncs_total) == (0, 0)
        assert await index_via_watch(stub) == {"w0": again.truth()}  # the earlier instances' blocks went with them
