"""Hot-prefix replication between two zones, real processes on loopback: zone a's cache-manager replicates
its hot prefixes into zone b through an inter-zone link (`kvmesh.bench.delay_proxy`, 1 ms each way): b's
worker pulls the blocks over kv-sync from a's worker (CRC-checked) into its CPU tier, b's index finds them
there, and a counts the bytes. A partition of the link fails the rounds; after the heal, only the prefix
still missing is copied, never the one verified before (counted on b: received prefixes by outcome, and
on b's worker: pulls that brought blocks)."""

from __future__ import annotations

from collections.abc import Callable

import grpc
import pytest

from kvmesh.bench.delay_proxy import ProxyProcess
from kvmesh.launcher import ServiceProcess
from kvmesh.v1 import cache_manager_pb2 as pb
from kvmesh.v1 import cache_manager_pb2_grpc as cm_grpc
from kvmesh.v1 import common_pb2
from tests.integration.test_cache_manager_zone_follow import generate, until
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
    services: Callable[..., ServiceProcess],
) -> None:
    cm_b = services("cache-manager", *CM_FLAGS, "--zone", "b")
    link = ProxyProcess(cm_b.address, delay_ms=1.0)  # a -> b: following and replication
    cm_a = services(
        "cache-manager", *CM_FLAGS, "--zone", "a", "--follow-zone", f"b={link.address}",
        "--replication-bytes-per-s", "50000000", "--replication-interval-s", "0.2", "--replication-threshold", "3",
    )  # fmt: skip
    worker_a = services("worker", *worker_flags("a", cm_a))
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

            link.cut()
            await generate(worker_a.address, "second", second)
            await until("a indexes the second prompt", lambda: holds(a, second, BLOCKS))
            await make_hot(a, second)
            await until("a round fails across the partition", lambda: failed(a))
            assert (await replication(a)).prefixes == 1

            link.heal()
            await until("the second prompt is replicated after the heal", lambda: replicated(a, 2))
            await until("b's index holds the second prompt", lambda: holds(b, second, BLOCKS))
            t = await replication(a)
            assert t.bytes_total == 2 * (BLOCKS - 1) * block_bytes  # the first prompt was not sent again
            assert metric(cm_b.http_port, "kvmesh_cache_replicas_received_total", 'outcome="pulled"') == 2
            assert pulls(worker_b) == 2
            assert metric(cm_a.http_port, "kvmesh_cache_replication_bytes_total", 'zone="b"') == t.bytes_total
        finally:
            link.close()


async def holds(stub: cm_grpc.CacheManagerServiceStub, prompt: list[int], blocks: int) -> bool:
    return await local_match(stub, prompt) >= blocks


async def replicated(stub: cm_grpc.CacheManagerServiceStub, n: int) -> bool:
    return (await replication(stub)).prefixes >= n


async def failed(stub: cm_grpc.CacheManagerServiceStub) -> bool:
    return (await replication(stub)).failures_total > 0


def pulls(worker: ServiceProcess) -> float:
    """Pull hints the worker followed that brought blocks (one per replicated prefix)."""
    return metric(worker.http_port, "kvmesh_worker_kv_pull_hints_total", 'pulled="true"')
