"""kill -9 of the cache-manager, restart from a Redis checkpoint (snapshot + event log): same index."""

from __future__ import annotations

import random
import signal
from collections.abc import Callable, Iterator
from pathlib import Path

import grpc
import pytest

from kvmesh.cachemgr.hasher import IndexHasher
from kvmesh.v1 import cache_manager_pb2 as pb
from kvmesh.v1 import cache_manager_pb2_grpc
from tests.integration.cache_manager.test_grpc import Publisher, index_via_watch, start_cm, workload
from tests.support.procs import ServiceProcess
from tests.support.redis_server import RedisServer, redis_server_fixture
from tests.unit.cachemgr.test_ingest_state import ToyEngine


@pytest.fixture
def redis_server(tmp_path: Path) -> Iterator[RedisServer]:
    yield from redis_server_fixture(tmp_path / "redis")


@pytest.mark.fault
async def test_kill9_restart_from_redis_gives_same_index(
    services: Callable[..., ServiceProcess], redis_server: RedisServer
) -> None:
    flags = ("--redis-url", redis_server.url, "--redis-prefix", "kvmesh:cm:test")
    cm = start_cm(services, *flags)
    hasher = IndexHasher("toy")
    rng = random.Random(9)
    prefixes = [[rng.randrange(500) for _ in range(16)] for _ in range(4)]
    engines = [ToyEngine(f"w{i}", hasher, seed=i) for i in range(3)]
    async with grpc.aio.insecure_channel(cm.address) as ch:
        stub = cache_manager_pb2_grpc.CacheManagerServiceStub(ch)
        pubs = [Publisher(stub, e) for e in engines]
        for p in pubs:
            await p.hello()
            for b in workload(rng, p.eng, prefixes, 10):
                assert not (await p.live(b)).resync_required
        ck = await stub.Checkpoint(pb.CheckpointRequest())
        assert ck.pairs > 0
        for p in pubs:  # after the snapshot: these live only in the Redis event log
            for b in workload(rng, p.eng, prefixes, 6):
                assert not (await p.live(b)).resync_required
        before = await index_via_watch(stub)
        stats_before = await stub.GetStats(pb.GetStatsRequest())
        for p in pubs:
            await p.close()
    assert before == {e.worker: e.truth() for e in engines}
    cm.proc.send_signal(signal.SIGKILL)
    assert cm.proc.wait(timeout=20) == -signal.SIGKILL

    cm2 = start_cm(services, *flags)
    async with grpc.aio.insecure_channel(cm2.address) as ch:
        stub = cache_manager_pb2_grpc.CacheManagerServiceStub(ch)
        assert await index_via_watch(stub) == before
        stats = await stub.GetStats(pb.GetStatsRequest())
        assert stats.pairs == stats_before.pairs and stats.workers == 3
        # the recovered sequence state lets workers continue without a resync
        p = Publisher(stub, engines[0])
        ack = await p.hello()
        assert ack.next_sequence == engines[0].seq and not ack.resync_required
        ack = await p.live(engines[0].prompt(prefixes[0] + [1] * 8))
        assert not ack.resync_required
        assert (await index_via_watch(stub))["w0"] == engines[0].truth()
        await p.close()
