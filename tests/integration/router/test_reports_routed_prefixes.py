"""A router routing from its fresh index replica reports what it routed, and the cache-manager's statistics see
it (real processes on 127.0.0.1: a cache-manager, an instant sim worker feeding it, a router following it).

Before reports, such a router asked the cache-manager nothing (FindMatches is its stale-replica fallback), so
`GetStats.top_prefixes` stayed empty however much traffic flowed. Now each routed prompt counts once: the
prompt's full-length prefix shows with the number of requests, under its tenant, and every request reached the
cache-manager as a report (`kvmesh_router_prefix_reports_total{outcome="sent"}`,
`kvmesh_cache_routed_prefixes_total`), none through the fallback.
"""

from __future__ import annotations

from collections.abc import Callable

import grpc
import pytest

from kvmesh.index import hashing
from kvmesh.suite.launcher import ServiceProcess
from kvmesh.v1 import cache_manager_pb2, cache_manager_pb2_grpc, common_pb2, router_pb2, router_pb2_grpc
from tests.support.poll import wait_until
from tests.support.scrape import metric

pytestmark = pytest.mark.integration
BS = 32
N = 3


def top_prefixes(cm: ServiceProcess) -> dict[int, cache_manager_pb2.PrefixStat]:
    with grpc.insecure_channel(cm.address) as ch:
        stats = cache_manager_pb2_grpc.CacheManagerServiceStub(ch).GetStats(
            cache_manager_pb2.GetStatsRequest(top_prefixes=100), timeout=10
        )
    return {p.key: p for p in stats.top_prefixes}


def test_prompts_routed_from_the_replica_show_in_the_cache_manager_s_top_prefixes(
    services: Callable[..., ServiceProcess],
) -> None:
    cm = services("cache-manager", "--block-size", str(BS))
    worker = services(
        "worker", "--engine", "sim", "--sim-speed", "0", "--block-size", str(BS), "--cache-manager", cm.address
    )
    router = services(
        "router", "--workers", worker.address, "--block-size", str(BS), "--cache-manager", cm.address,
        "--prefix-report-flush-ms", "20",
    )  # fmt: skip
    prompt = [(7 + i) % 1000 + 3 for i in range(10 * BS)]
    key = int(hashing.compute_block_hashes(prompt, BS, int(hashing.make_salt("", None, "A")))[-1])
    req = router_pb2.RouterServiceGenerateRequest(
        token_ids=common_pb2.TokenIds(ids=prompt), sampling=common_pb2.SamplingParams(max_tokens=2), tenant="A"
    )
    with grpc.insecure_channel(router.address) as ch:
        for _ in range(N):
            assert list(router_pb2_grpc.RouterServiceStub(ch).Generate(req, timeout=30))[-1].finish_reason

    def sent() -> float:
        return metric(router.http_port, "kvmesh_router_prefix_reports_total", 'outcome="sent"')

    wait_until(lambda: sent() >= N and key in top_prefixes(cm))
    top = top_prefixes(cm)[key]
    assert (top.blocks, top.window_count, top.total, top.tenant) == (10, N, N, "A")  # each request counted once
    assert sent() == N
    assert metric(cm.http_port, "kvmesh_cache_routed_prefixes_total") == N  # none came through FindMatches
