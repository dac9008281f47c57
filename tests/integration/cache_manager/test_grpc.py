"""The cache-manager over real gRPC: ingestion stream with acks, gap → resync (full dump) → exact index,
FindMatches, WatchIndex replicas, checkpoints, stats and metrics. A real service process on loopback."""

from __future__ import annotations

import asyncio
import random
from collections.abc import AsyncIterator, Callable
from pathlib import Path

import grpc
import pytest

from kvmesh.cachemgr.hasher import IndexHasher
from kvmesh.core.kvevents import KvEventBatch
from kvmesh.v1 import cache_manager_pb2 as pb
from kvmesh.v1 import cache_manager_pb2_grpc, common_pb2
from kvmesh.wire.proto import batch_to_proto, event_to_proto
from tests.support.procs import ServiceProcess
from tests.unit.cachemgr.test_ingest_state import BS, ToyEngine

MODEL = "toy"


class Publisher:
    """A worker's side of PublishKvEvents: send one message, await its ack (bounded)."""

    def __init__(self, stub: cache_manager_pb2_grpc.CacheManagerServiceStub, eng: ToyEngine) -> None:
        self.eng = eng
        self.q: asyncio.Queue[pb.PublishKvEventsRequest | None] = asyncio.Queue()
        self.call = stub.PublishKvEvents(self._requests())

    async def _requests(self) -> AsyncIterator[pb.PublishKvEventsRequest]:
        for _ in range(1 << 20):
            r = await self.q.get()
            if r is None:
                return
            yield r

    async def send(self, req: pb.PublishKvEventsRequest) -> pb.PublishKvEventsResponse:
        await self.q.put(req)
        return await asyncio.wait_for(self.call.read(), 20)

    async def hello(self) -> pb.PublishKvEventsResponse:
        return await self.send(
            pb.PublishKvEventsRequest(
                hello=pb.WorkerHello(
                    worker_id=self.eng.worker, instance_id=self.eng.instance, block_size=BS, model=MODEL
                )
            )
        )

    async def live(self, b: KvEventBatch) -> pb.PublishKvEventsResponse:
        return await self.send(pb.PublishKvEventsRequest(kind=common_pb2.KV_STREAM_KIND_LIVE, batch=batch_to_proto(b)))

    async def dump(self) -> pb.PublishKvEventsResponse:
        """Full dump at the engine's current sequence: BEGIN, CHUNKs of 2 events, END."""
        evs = self.eng.dump()
        last = self.eng.seq - 1

        def mk(kind: int, chunk: list) -> pb.PublishKvEventsRequest:
            batch = common_pb2.KvEventBatch(
                worker_id=self.eng.worker,
                instance_id=self.eng.instance,
                sequence=last,
                events=[event_to_proto(e) for e in chunk],
            )
            return pb.PublishKvEventsRequest(kind=kind, batch=batch)

        await self.send(mk(common_pb2.KV_STREAM_KIND_DUMP_BEGIN, []))
        for i in range(0, len(evs), 2):
            await self.send(mk(common_pb2.KV_STREAM_KIND_DUMP_CHUNK, evs[i : i + 2]))
        return await self.send(mk(common_pb2.KV_STREAM_KIND_DUMP_END, []))

    async def close(self) -> None:
        await self.q.put(None)
        self.call.cancel()


async def index_via_watch(stub: cache_manager_pb2_grpc.CacheManagerServiceStub) -> dict[str, set[int]]:
    """The whole index, as a new WatchIndex subscriber's snapshot rebuilds it."""
    out: dict[str, set[int]] = {}
    call = stub.WatchIndex(pb.WatchIndexRequest())
    try:
        for _ in range(1 << 20):
            msg = await asyncio.wait_for(call.read(), 20)
            for d in msg.deltas:
                if d.cleared:
                    out[d.worker_id] = set()
                out.setdefault(d.worker_id, set()).update(d.stored)
            if msg.snapshot_done:
                return {w: s for w, s in out.items() if s}
    finally:
        call.cancel()
    raise AssertionError("no end of snapshot")


def start_cm(services: Callable[..., ServiceProcess], *extra: str) -> ServiceProcess:
    return services(
        "cache-manager",
        "--block-size",
        str(BS),
        "--model",
        MODEL,
        "--warm-interval-s",
        "0",
        "--checkpoint-interval-s",
        "0",
        *extra,
    )


def workload(rng: random.Random, eng: ToyEngine, prefixes: list[list[int]], n: int) -> list[KvEventBatch]:
    out = []
    for i in range(n):
        if i % 5 == 4:
            out.append(eng.evict(2, rng))
        else:
            out.append(eng.prompt(rng.choice(prefixes) + [rng.randrange(500) for _ in range(rng.randrange(9))]))
    return out


@pytest.mark.integration
async def test_gap_resync_and_queries_over_grpc(services: Callable[..., ServiceProcess], tmp_path: Path) -> None:
    cm = start_cm(services, "--checkpoint-dir", str(tmp_path / "ck"))
    hasher = IndexHasher(MODEL)
    rng = random.Random(5)
    prefixes = [[rng.randrange(500) for _ in range(16)] for _ in range(3)]
    async with grpc.aio.insecure_channel(cm.address) as ch:
        stub = cache_manager_pb2_grpc.CacheManagerServiceStub(ch)
        watch = stub.WatchIndex(pb.WatchIndexRequest())
        first = await asyncio.wait_for(watch.read(), 20)
        assert first.snapshot_done and not first.deltas
        engines = [ToyEngine(f"w{i}", hasher, seed=i) for i in range(2)]
        pubs = [Publisher(stub, e) for e in engines]
        for p in pubs:
            assert (await p.hello()).next_sequence == 0
        for p in pubs:
            for b in workload(rng, p.eng, prefixes, 12):
                ack = await p.live(b)
                assert not ack.resync_required and ack.next_sequence == b.sequence + 1
        # w0 loses a batch: the next one is acknowledged with a resync request, nothing past it applied
        e0 = engines[0]
        e0.prompt(prefixes[0] + [1, 2, 3, 4])
        ack = await pubs[0].live(e0.prompt(prefixes[1] + [9, 9, 9, 9]))
        assert ack.resync_required and "gap" in ack.reason
        ack = await pubs[0].dump()
        assert not ack.resync_required and ack.next_sequence == e0.seq
        ack = await pubs[0].live(e0.prompt(prefixes[2] + [7] * 8))
        assert not ack.resync_required
        got = await index_via_watch(stub)
        assert got == {e.worker: e.truth() for e in engines if e.truth()}
        # FindMatches by token ids equals a local evaluation of the truth
        for pre in prefixes:
            hs = hasher.chain(None, pre, BS, None)
            want = {}
            for e in engines:
                k = next((i for i, h in enumerate(hs) if h not in e.truth()), len(hs))
                if k:
                    want[e.worker] = k
            resp = await stub.FindMatches(pb.FindMatchesRequest(token_ids=common_pb2.TokenIds(ids=pre)))
            assert {mm.worker_id: mm.matched_blocks for mm in resp.matches} == want
            assert resp.total_blocks == len(hs)
            by_hash = await stub.FindMatches(pb.FindMatchesRequest(block_hashes=pb.BlockHashes(hashes=hs)))
            assert by_hash.matches == resp.matches
        # the watcher that subscribed at the start followed every delta to the same index
        replica: dict[str, set[int]] = {}
        for _ in range(10_000):
            msg = await asyncio.wait_for(watch.read(), 20)
            for d in msg.deltas:
                if d.cleared:
                    replica[d.worker_id] = set()
                s = replica.setdefault(d.worker_id, set())
                s.update(d.stored)
                s.difference_update(d.removed)
            if {w: s for w, s in replica.items() if s} == got:
                break
        watch.cancel()
        stats = await stub.GetStats(pb.GetStatsRequest())
        assert stats.gaps_total == 1 and stats.resyncs_total == 1 and stats.workers == 2
        assert stats.pairs == sum(len(s) for s in got.values())
        assert 0 < stats.hit_ratio <= 1
        ck = await stub.Checkpoint(pb.CheckpointRequest())
        assert ck.pairs == stats.pairs and ck.bytes > 0
        for p in pubs:
            await p.close()
    import urllib.request

    body = urllib.request.urlopen(f"http://127.0.0.1:{cm.http_port}/metrics", timeout=10).read().decode()
    for name in (
        "kvmesh_cache_hit_ratio",
        "kvmesh_cache_miss_ratio",
        "kvmesh_cache_sequence_gaps_total 1.0",
        "kvmesh_cache_query_latency_seconds_bucket",
        "kvmesh_cache_index_pairs",
    ):
        assert name in body, name
