"""The router's index replica follows a real cache-manager's WatchIndex stream and agrees with FindMatches.

The test publishes KV events to the cache-manager exactly as a worker does (PublishKvEvents: hello, then
numbered batches), then compares the replica's local answer with the cache-manager's own.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable

import grpc
import pytest

from kvmesh.core.config import ServerSettings
from kvmesh.index import hashing
from kvmesh.services.router.index_replica import IndexReplica
from kvmesh.suite.launcher import ServiceProcess
from kvmesh.v1 import cache_manager_pb2 as cm_pb2
from kvmesh.v1 import cache_manager_pb2_grpc as cm_grpc
from kvmesh.v1 import common_pb2

pytestmark = pytest.mark.integration
BS = 32
MODEL = "tiny"


def stored(tokens: list[int], engine_hashes: list[int], parent: int | None = None) -> common_pb2.KvEvent:
    ev = common_pb2.BlockStored(block_hashes=engine_hashes, token_ids=tokens, block_size=BS)
    if parent is not None:
        ev.parent_block_hash = parent
    return common_pb2.KvEvent(block_stored=ev)


async def publish(address: str, worker: str, batches: list[list[common_pb2.KvEvent]], first_seq: int = 0) -> None:
    async def reqs():  # type: ignore[no-untyped-def]
        yield cm_pb2.PublishKvEventsRequest(hello=cm_pb2.WorkerHello(worker_id=worker, instance_id="i1", block_size=BS))
        for seq, events in enumerate(batches, start=first_seq):
            yield cm_pb2.PublishKvEventsRequest(
                kind=common_pb2.KV_STREAM_KIND_LIVE,
                batch=common_pb2.KvEventBatch(worker_id=worker, instance_id="i1", sequence=seq, events=events),
            )

    async with grpc.aio.insecure_channel(address) as ch:
        acks = [a async for a in cm_grpc.CacheManagerServiceStub(ch).PublishKvEvents(reqs())]
    assert not any(a.resync_required for a in acks)


async def wait_until(replica: IndexReplica, cond: Callable[[], bool], timeout: float = 10.0) -> None:
    """Waits on the replica's update event (no sleeps) until `cond()` holds."""

    async def loop() -> None:
        while not cond():
            replica.updated.clear()
            await replica.updated.wait()

    await asyncio.wait_for(loop(), timeout)


async def test_replica_tracks_watch_and_matches_find_matches(services: Callable[..., ServiceProcess]) -> None:
    cm = services("cache-manager", "--block-size", str(BS), "--model", MODEL)
    replica = IndexReplica(cm.address, ServerSettings())
    await replica.start()
    try:
        await asyncio.wait_for(replica.synced.wait(), 10)
        tokens = list(range(1000, 1000 + 6 * BS))
        hashes = hashing.compute_block_hashes(tokens, BS, int(hashing.make_salt(MODEL)))
        assert await replica.matches(hashes) == {}
        # wA holds 6 blocks, wB the first 2
        await publish(cm.address, "wA", [[stored(tokens, [11, 12, 13, 14, 15, 16])]])
        await publish(cm.address, "wB", [[stored(tokens[: 2 * BS], [21, 22])]])
        await wait_until(replica, lambda: replica.index.find_matches(hashes) == {"wA": 6, "wB": 2})
        local = await replica.matches(hashes)
        assert local == {"wA": 6, "wB": 2}
        # a replica that is not following the stream (stale) asks the cache-manager: same answer
        stale = IndexReplica(cm.address, ServerSettings())
        assert not stale.fresh
        assert await stale.matches(hashes) == local
        assert stale.fallbacks == 1
        await stale.stop()
        # removal propagates too
        removed = common_pb2.KvEvent(block_removed=common_pb2.BlockRemoved(block_hashes=[22]))
        await publish(cm.address, "wB", [[removed]], first_seq=1)
        await wait_until(replica, lambda: replica.index.find_matches(hashes) == {"wA": 6, "wB": 1})
    finally:
        await replica.stop()


async def test_no_cache_manager_means_no_overlap() -> None:
    r = IndexReplica("", ServerSettings())
    await r.start()
    assert await r.matches([1, 2, 3]) == {}
    await r.stop()
