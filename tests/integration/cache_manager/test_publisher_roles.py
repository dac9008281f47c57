"""The cache-manager's per-role rules on KV event publishers (the security review's index poisoning), over real gRPC.

* A stream authenticated as worker Y publishing for X (a hello with a new instance_id, or batches naming X) is
  PERMISSION_DENIED naming both; X's entries, instance and FindMatches answer stay as they were, and X's own
  events still apply afterwards.
* One anonymous stream announcing 2,000 fake workers, or 100K blocks at once, is cut at the configured bound
  (RESOURCE_EXHAUSTED with retry info) before the index takes the excess.
* SSRF: a hello naming an attacker's address makes a real cache-manager process dial nothing there; it dials
  the address its registry gives for that worker id (a real listening socket records who connects).

Identities come from `tests.support.identity` (a stand-in for the authorisation core's server skeleton,
which sets the same `identity_var` for the handler): the identity tests run the servicer in-process behind it;
the SSRF test runs the real service process, whose wiring (registry, warmer) is under test.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Callable, Iterator
from pathlib import Path

import grpc
import pytest

from kvmesh.cachemgr.core import CacheCore
from kvmesh.cachemgr.publisher import PublishLimits
from kvmesh.core.kvevents import BlockStored, KvEventBatch
from kvmesh.discovery.model import CatalogSnapshot, Role, ServiceInstance
from kvmesh.discovery.static import write_catalog
from kvmesh.ops.warming import WarmingConfig
from kvmesh.rpc.errors import retry_after_s
from kvmesh.security.identity import CallerRole, Identity
from kvmesh.services.cache_manager.servicer import CacheManagerServicer
from kvmesh.services.cache_manager.warming import Warmer
from kvmesh.v1 import cache_manager_pb2 as pb
from kvmesh.v1 import cache_manager_pb2_grpc, common_pb2
from kvmesh.wire.proto import batch_to_proto
from tests.support.identity import metadata_of, serve
from tests.support.procs import ServiceProcess
from tests.unit.cachemgr.test_ingest_state import BS, ToyEngine

pytestmark = pytest.mark.integration
MODEL = "toy"
X = Identity(CallerRole.WORKER, "worker-x")
Y = Identity(CallerRole.WORKER, "worker-y")
PROMPT = list(range(1, 4 * BS + 1))  # four full blocks


def hello(worker: str, instance: str, address: str = "") -> pb.PublishKvEventsRequest:
    return pb.PublishKvEventsRequest(
        hello=pb.WorkerHello(worker_id=worker, instance_id=instance, block_size=BS, model=MODEL, address=address)
    )


def live(b: KvEventBatch) -> pb.PublishKvEventsRequest:
    return pb.PublishKvEventsRequest(kind=common_pb2.KV_STREAM_KIND_LIVE, batch=batch_to_proto(b))


async def publish(
    stub: cache_manager_pb2_grpc.CacheManagerServiceStub,
    msgs: list[pb.PublishKvEventsRequest],
    ident: Identity | None,
) -> list[pb.PublishKvEventsResponse]:
    """Send `msgs` one at a time, each after the previous ack; returns the acks (the call's error raises)."""
    acked: asyncio.Queue[None] = asyncio.Queue()

    async def requests() -> AsyncIterator[pb.PublishKvEventsRequest]:
        for m in msgs:
            yield m
            await asyncio.wait_for(acked.get(), 20)

    call = stub.PublishKvEvents(requests(), metadata=metadata_of(ident), timeout=30)
    acks = []
    async for ack in call:
        acks.append(ack)
        acked.put_nowait(None)
        if len(acks) == len(msgs):
            call.cancel()
            break
    return acks


async def matches(stub: cache_manager_pb2_grpc.CacheManagerServiceStub, tokens: list[int]) -> dict[str, int]:
    req = pb.FindMatchesRequest(token_ids=common_pb2.TokenIds(ids=tokens), model=MODEL)
    return {m.worker_id: m.matched_blocks for m in (await stub.FindMatches(req, timeout=10)).matches}


class CacheManagerInProcess:
    """The cache-manager servicer on a loopback gRPC server behind the identity stand-in."""

    def __init__(self, limits: PublishLimits | None = None) -> None:
        self.core = CacheCore(BS, MODEL)
        self.warmer = Warmer(self.core, WarmingConfig(), 1000, 60.0)
        self.servicer = CacheManagerServicer(self.core, self.warmer, asyncio.Event(), "", limits)

    async def __aenter__(self) -> cache_manager_pb2_grpc.CacheManagerServiceStub:
        add = cache_manager_pb2_grpc.add_CacheManagerServiceServicer_to_server
        self.server, address = await serve(add, self.servicer, "cache-manager")
        self.channel = grpc.aio.insecure_channel(address)
        return cache_manager_pb2_grpc.CacheManagerServiceStub(self.channel)

    async def __aexit__(self, *exc: object) -> None:
        await self.channel.close()
        await self.server.stop(None)
        await self.warmer.close()


async def test_worker_y_cannot_publish_as_x_and_x_is_unchanged() -> None:
    cm = CacheManagerInProcess()
    async with cm as stub:
        eng = ToyEngine(X.id, None, seed=1)
        await publish(stub, [hello(X.id, eng.instance), live(eng.prompt(PROMPT))], X)
        before = await matches(stub, PROMPT)
        assert before == {X.id: 4}
        blocks, revision = cm.core.index.num_blocks(X.id), cm.core.revision

        # the attack of the issue: a hello naming X with a new instance id (would wipe X and drop its events)
        with pytest.raises(grpc.aio.AioRpcError) as ei:
            await publish(stub, [hello(X.id, "forged-instance")], Y)
        assert ei.value.code() == grpc.StatusCode.PERMISSION_DENIED
        assert "worker:worker-y" in (ei.value.details() or "") and "worker-x" in (ei.value.details() or "")

        # a stream that says hello as itself, then slips in a batch naming X ("X holds P")
        forged = KvEventBatch(
            X.id, "forged-instance", 0, 1e12, (BlockStored((99, 98), None, tuple(range(900, 908)), BS),)
        )
        with pytest.raises(grpc.aio.AioRpcError) as ei:
            await publish(stub, [hello(Y.id, "y0"), live(forged)], Y)
        assert ei.value.code() == grpc.StatusCode.PERMISSION_DENIED
        assert "batch.worker_id" in (ei.value.details() or "")

        # an admin is no worker either
        admin = Identity(CallerRole.ADMIN, "ops")
        with pytest.raises(grpc.aio.AioRpcError) as ei:
            await publish(stub, [hello(X.id, "forged-instance")], admin)
        assert ei.value.code() == grpc.StatusCode.PERMISSION_DENIED

        st = cm.core.ingestor.workers[X.id]
        assert (st.instance_id, st.next_sequence, cm.core.ingestor.counters.restarts) == (eng.instance, 1, 0)
        assert cm.core.index.num_blocks(X.id) == blocks
        assert cm.core.revision == revision  # no delta reached the routers' index replicas (WatchIndex)
        assert await matches(stub, PROMPT) == before
        assert await matches(stub, list(range(900, 908))) == {}

        # X's own events still apply (nothing was retired or marked out of sync)
        more = PROMPT + list(range(500, 500 + 2 * BS))
        acks = await publish(stub, [hello(X.id, eng.instance), live(eng.prompt(more))], X)
        assert not acks[-1].resync_required and acks[-1].next_sequence == 2
        assert await matches(stub, more) == {X.id: 6}


async def test_two_thousand_fake_workers_on_one_stream_are_cut_at_the_bound() -> None:
    cm = CacheManagerInProcess(PublishLimits(max_workers=4))
    async with cm as stub:
        flood = [hello(f"fake-{i}", "i0") for i in range(2000)]
        with pytest.raises(grpc.aio.AioRpcError) as ei:
            await publish(stub, flood, None)  # anonymous: the service runs without auth
        assert ei.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        assert "at most 4 workers" in (ei.value.details() or "")
        assert retry_after_s(ei.value) == pytest.approx(1.0)
        assert set(cm.warmer.addresses) <= {f"fake-{i}" for i in range(4)}
        assert len(cm.core.ingestor.workers) == 0


async def test_one_stream_storing_100k_blocks_at_once_is_refused_and_nothing_applied() -> None:
    cm = CacheManagerInProcess(PublishLimits(max_workers=4, burst_blocks=1_000, blocks_per_s=100.0))
    async with cm as stub:
        eng = ToyEngine("w", None, seed=3)
        ok = eng.prompt(list(range(1, 800 * BS + 1)))  # 800 blocks: within the burst
        big = KvEventBatch(
            "w",
            eng.instance,
            1,
            2e12,
            (BlockStored(tuple(range(10**6, 10**6 + 100_000)), None, tuple([7] * 100_000 * BS), BS),),
        )
        with pytest.raises(grpc.aio.AioRpcError) as ei:
            await publish(stub, [hello("w", eng.instance), live(ok), live(big)], None)
        assert ei.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        assert cm.core.index.num_blocks("w") == 800  # the first batch, not the refused one
        assert (retry_after_s(ei.value) or 0) > 0


@pytest.fixture
def listener() -> Iterator[Callable[[], tuple[str, list[str]]]]:
    """`listener()` opens a real TCP socket on 127.0.0.1 that records every connection made to it."""
    import socket
    import threading

    socks: list[socket.socket] = []

    def open_one() -> tuple[str, list[str]]:
        s = socket.socket()
        s.bind(("127.0.0.1", 0))
        s.listen(16)
        s.settimeout(0.2)
        seen: list[str] = []
        socks.append(s)

        def accept() -> None:
            while s.fileno() != -1:
                try:
                    conn, peer = s.accept()
                except (TimeoutError, OSError):
                    continue
                seen.append(f"{peer[0]}:{peer[1]}")
                conn.close()

        threading.Thread(target=accept, daemon=True).start()
        return f"127.0.0.1:{s.getsockname()[1]}", seen

    yield open_one
    for s in socks:
        s.close()


async def test_hello_address_is_never_dialled_only_the_registry_address(
    services: Callable[..., ServiceProcess], listener: Callable[[], tuple[str, list[str]]], tmp_path: Path
) -> None:
    attacker, attacker_seen = listener()
    registered, registered_seen = listener()
    host, _, port = registered.rpartition(":")
    reg = tmp_path / "registry.yaml"
    write_catalog(reg, CatalogSnapshot.of([ServiceInstance(X.id, Role.WORKER, "local", "v1", host, int(port))]))
    cm = services(
        "cache-manager",
        "--block-size",
        str(BS),
        "--model",
        MODEL,
        "--registry-file",
        str(reg),
        "--warm-interval-s",
        "0",
    )
    async with grpc.aio.insecure_channel(cm.address) as ch:
        stub = cache_manager_pb2_grpc.CacheManagerServiceStub(ch)
        # the forger's hello: X lives at the attacker's address; and an unregistered worker, also there
        await publish(stub, [hello(X.id, "forged", attacker), hello("ghost", "g0", attacker)], None)
        warm = pb.WarmPrefixesRequest(prompts=[common_pb2.TokenIds(ids=PROMPT)], replicas=2)
        res = await stub.WarmPrefixes(warm, timeout=30)
    # the registry's address of X was dialled (it speaks no gRPC: the warming failed), never the attacker's
    assert res.requests_issued == 0
    assert registered_seen, "the cache-manager did not dial the registry's address of the worker"
    assert attacker_seen == []
    log = cm.log()
    assert "not in the registry" in log  # ghost: said hello, absent from the registry, not dialled
