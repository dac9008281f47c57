"""Hot-prefix replication between two zones, real processes on loopback: zone a's cache-manager replicates its
hot prefixes into zone b through an inter-zone link (`kvmesh.bench.delay_proxy`, 1 ms each way): b's worker
pulls the blocks over kv-sync from a's worker (CRC-checked) into its CPU tier, b's index finds them there, and
a counts the bytes. Each prefix carries the lease a's cache-manager took at a's worker, and b's worker reads
under it, asking a's worker for no lease of its own. A partition of the link fails the rounds; after the heal,
only the prefix still missing is copied, never the one verified before (counted on b: received prefixes by
outcome, and on b's worker: pulls that brought blocks). Zone a's cache-manager, registered in Consul (the
stand-in agent, a real process), lists zone b in its `replication_pending` meta exactly while a hot prefix is
not verified there or b's index is not followed live, and its health check stays passing through the
re-registrations that change the meta."""

from __future__ import annotations

import asyncio
import signal
from collections.abc import Callable, Iterator

import grpc
import pytest

from kvmesh.bench.delay_proxy import ProxyProcess
from kvmesh.discovery.consul import ConsulRegistry
from kvmesh.discovery.model import REPLICATION_PENDING_META, Health
from kvmesh.suite.launcher import ServiceProcess
from kvmesh.v1 import cache_manager_pb2 as pb
from kvmesh.v1 import cache_manager_pb2_grpc as cm_grpc
from kvmesh.v1 import common_pb2
from tests.consul_standin.launch import StandinProcess, start_standin
from tests.integration.cache_manager.test_zone_follow import generate, until
from tests.support.scrape import metric
from tests.support.sim_worker import BS

pytestmark = pytest.mark.integration
MODEL = "sim-replica-model"
CM_FLAGS = ("--block-size", str(BS), "--model", MODEL, "--checkpoint-interval-s", "0", "--warm-interval-s", "0")
BLOCKS = 8  # per prompt: 7 are pulled, the last one is computed by the receiving worker


def worker_flags(zone: str, cm: ServiceProcess) -> tuple[str, ...]:
    return (
        "--engine", "sim", "--model", MODEL, "--block-size", str(BS), "--kv-blocks", "512", "--sim-speed", "0",
        "--zone", zone, "--cache-manager", cm.address,
    )  # fmt: skip


@pytest.fixture
def standin() -> Iterator[StandinProcess]:
    sp = start_standin()
    yield sp
    sp.stop()


async def pending_meta(registry: ConsulRegistry, want: str, timeout_s: float = 30.0) -> None:
    """Follows the catalog (blocking queries, bounded) until cache-manager-a-0's meta lists `want` as pending,
    asserting at every change that its health check is passing (a re-registration keeps the check's status)."""
    deadline = asyncio.get_running_loop().time() + timeout_s
    index, snap = await registry.snapshot()
    while True:
        inst = snap.by_id().get("cache-manager-a-0")
        if inst is not None:
            assert inst.health is Health.PASSING, inst
            if inst.meta.get(REPLICATION_PENDING_META, "") == want:
                return
        left = deadline - asyncio.get_running_loop().time()
        assert left > 0, f"replication_pending never became {want!r}: {inst}"
        index, snap = await registry.watch(index, wait_s=min(left, 2.0))


async def make_hot(stub: cm_grpc.CacheManagerServiceStub, prompt: list[int], times: int = 3) -> None:
    for _ in range(times):  # FindMatches queries count in the prefix statistics, as a router's do
        await stub.FindMatches(pb.FindMatchesRequest(token_ids=common_pb2.TokenIds(ids=prompt)), timeout=5)


async def local_match(stub: cm_grpc.CacheManagerServiceStub, prompt: list[int]) -> int:
    r = await stub.FindMatches(pb.FindMatchesRequest(token_ids=common_pb2.TokenIds(ids=prompt)), timeout=5)
    return max((x.matched_blocks for x in r.matches), default=0)


async def replication(stub: cm_grpc.CacheManagerServiceStub) -> pb.GetStatsResponse.ReplicationTarget:
    (t,) = (await stub.GetStats(pb.GetStatsRequest(), timeout=5)).replication
    return t


async def test_hot_prefixes_are_replicated_verified_and_resume_after_a_partition(
    services: Callable[..., ServiceProcess], standin: StandinProcess
) -> None:
    cm_b = services("cache-manager", *CM_FLAGS, "--zone", "b")
    link = ProxyProcess(cm_b.address, delay_ms=1.0)  # a -> b: following and replication
    cm_a = services(
        "cache-manager", *CM_FLAGS, "--zone", "a", "--follow-zone", f"b={link.address}",
        "--replication-bytes-per-s", "50000000", "--replication-interval-s", "0.2", "--replication-threshold", "3",
        "--consul-url", f"http://127.0.0.1:{standin.port}", "--service-id", "cache-manager-a-0",
    )  # fmt: skip
    consul = ConsulRegistry(port=standin.port, request_timeout_s=3.0)
    # in a Consul deployment every service registers: a's cache-manager finds a's worker there
    worker_a = services("worker", *worker_flags("a", cm_a), "--consul-url", f"http://127.0.0.1:{standin.port}")
    worker_b = services("worker", *worker_flags("b", cm_b))
    first = list(range(100, 100 + BLOCKS * BS))
    second = list(range(9000, 9000 + BLOCKS * BS))
    async with grpc.aio.insecure_channel(cm_a.address) as ch_a, grpc.aio.insecure_channel(cm_b.address) as ch_b:
        a, b = cm_grpc.CacheManagerServiceStub(ch_a), cm_grpc.CacheManagerServiceStub(ch_b)
        try:
            own = list(range(20000, 20000 + 2 * BS))  # b's worker is connected to b's cache-manager once indexed
            await generate(worker_b.address, "own", own)
            await until("b's worker is registered", lambda: holds(b, own, 2))
            await generate(worker_a.address, "first", first)
            await until("a indexes the first prompt", lambda: holds(a, first, BLOCKS))
            assert await local_match(b, first) == 0
            await make_hot(a, first)
            await until("the first prompt is replicated", lambda: replicated(a, 1))
            t = await replication(a)
            assert (t.zone, t.prefixes, t.failures_total) == ("b", 1, 0)
            assert t.blocks == BLOCKS - 1 and t.budget_bytes_per_s == 50_000_000
            block_bytes = t.bytes_total // (BLOCKS - 1)
            assert block_bytes > 0 and t.bytes_total == (BLOCKS - 1) * block_bytes
            await until("b's index holds it on b's worker", lambda: holds(b, first, BLOCKS))
            assert pulls(worker_b) == 1
            assert metric(cm_b.http_port, "kvmesh_cache_replicas_received_total", 'outcome="pulled"') == 1
            # the lease a's cache-manager took at a's worker came with the prefix: b's worker read under it and
            # asked a's worker for none of its own (the one AcquireLease a's kv-sync served is the cache-manager's)
            assert leases_taken(cm_a) == 1
            assert metric(worker_b.http_port, "kvmesh_kvsync_carried_leases_total", 'outcome="used"') == 1
            assert metric(worker_b.http_port, "kvmesh_kvsync_carried_leases_total") == 1
            assert acquire_leases(worker_a) == 1
            await pending_meta(consul, "")
            assert not (await replication(a)).pending

            link.cut()
            await pending_meta(consul, "b")  # b's index is no longer followed live
            await generate(worker_a.address, "second", second)
            await until("a indexes the second prompt", lambda: holds(a, second, BLOCKS))
            await make_hot(a, second)
            await until("a round fails across the partition", lambda: failed(a))
            t = await replication(a)
            assert t.prefixes == 1 and t.pending
            assert metric(cm_a.http_port, "kvmesh_cache_replication_pending", 'zone="b"') == 1

            link.heal()
            await until("the second prompt is replicated after the heal", lambda: replicated(a, 2))
            await until("b's index holds the second prompt", lambda: holds(b, second, BLOCKS))
            t = await replication(a)
            assert t.bytes_total == 2 * (BLOCKS - 1) * block_bytes  # the first prompt was not sent again
            assert metric(cm_b.http_port, "kvmesh_cache_replicas_received_total", 'outcome="pulled"') == 2
            assert pulls(worker_b) == 2
            assert metric(cm_a.http_port, "kvmesh_cache_replication_bytes_total", 'zone="b"') == t.bytes_total
            # the round across the partition took a lease too (it expired unused on a's worker)
            assert acquire_leases(worker_a) == leases_taken(cm_a) >= 2
            assert metric(worker_b.http_port, "kvmesh_kvsync_carried_leases_total", 'outcome="used"') == 2
            await pending_meta(consul, "")  # both prompts verified in b, b followed live again
        finally:
            link.close()
            await consul.close(deregister=False)


async def holds(stub: cm_grpc.CacheManagerServiceStub, prompt: list[int], blocks: int) -> bool:
    return await local_match(stub, prompt) >= blocks


async def replicated(stub: cm_grpc.CacheManagerServiceStub, n: int) -> bool:
    return (await replication(stub)).prefixes >= n


async def failed(stub: cm_grpc.CacheManagerServiceStub) -> bool:
    return (await replication(stub)).failures_total > 0


def leases_taken(cm: ServiceProcess) -> float:
    """Leases the cache-manager took at its zone's workers and sent with a replicated prefix."""
    return metric(cm.http_port, "kvmesh_cache_replication_leases_total", 'outcome="taken"')


def acquire_leases(worker: ServiceProcess) -> float:
    """AcquireLease calls the worker's kv-sync server answered."""
    return metric(worker.http_port, "kvmesh_rpc_requests_total", 'method="AcquireLease",service="kvsync"')


def pulls(worker: ServiceProcess) -> float:
    """Pull hints the worker followed that brought blocks (one per replicated prefix)."""
    return metric(worker.http_port, "kvmesh_worker_kv_pull_hints_total", 'pulled="true"')


async def test_a_silent_link_shows_the_zone_pending_within_seconds(services: Callable[..., ServiceProcess]) -> None:
    """The link to zone b goes silent (its proxy stopped: connections stay open, nothing answers, as a zone
    lost with its link): a's index stream and replication channel ping every 2 s, so b is not followed live,
    and so pending, within about 3 s, not after TCP's or a 15 s keepalive's timeout."""
    cm_b = services("cache-manager", *CM_FLAGS, "--zone", "b")
    link = ProxyProcess(cm_b.address, delay_ms=1.0)
    cm_a = services(
        "cache-manager", *CM_FLAGS, "--zone", "a", "--follow-zone", f"b={link.address}",
        "--replication-bytes-per-s", "50000000", "--replication-interval-s", "0.2",
    )  # fmt: skip
    async with grpc.aio.insecure_channel(cm_a.address) as ch_a:
        a = cm_grpc.CacheManagerServiceStub(ch_a)
        try:
            await until("a follows b live", lambda: followed_live(a), timeout=20)
            await until("nothing pending for b", lambda: not_pending(a), timeout=20)
            link.proc.send_signal(signal.SIGSTOP)
            t0 = asyncio.get_running_loop().time()
            await until("b is not followed live once its link is silent", lambda: not_live(a), timeout=15)
            await until("b is pending once its link is silent", lambda: is_pending(a), timeout=15)
            took = asyncio.get_running_loop().time() - t0
            assert not (await a.GetStats(pb.GetStatsRequest(), timeout=5)).followed_zones[0].connected
            print("silent link noticed after", round(took, 2), "s")
            assert took < 8.0  # 2 s ping + 1 s timeout + a 0.2 s round, with room for 2 busy cores; not 15 s
        finally:
            link.proc.send_signal(signal.SIGCONT)
            link.close()


async def followed_live(stub: cm_grpc.CacheManagerServiceStub) -> bool:
    return all(z.connected for z in (await stub.GetStats(pb.GetStatsRequest(), timeout=5)).followed_zones)


async def is_pending(stub: cm_grpc.CacheManagerServiceStub) -> bool:
    return (await replication(stub)).pending


async def not_pending(stub: cm_grpc.CacheManagerServiceStub) -> bool:
    return not (await replication(stub)).pending


async def not_live(stub: cm_grpc.CacheManagerServiceStub) -> bool:
    return not await followed_live(stub)
