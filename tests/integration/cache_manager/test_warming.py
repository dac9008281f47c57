"""Cache-manager warming end to end: a real cache-manager and 3 real simulated workers on loopback.

Static templates from a configured file are preloaded onto every worker as it registers; a prefix that
routers query (FindMatches) ≥ threshold times in the window is warmed onto one more worker by prefill-only
`Generate` requests through the worker API; `SetWarmingPolicy` changes the threshold and the replica cap
and rejects bad input; `WarmPrefixes` warms on demand; `kvmesh_cache_warming_actions_total` counts it all.
Conditions are awaited through GetStats (which does not feed the prefix statistics), with deadlines.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import Awaitable, Callable
from pathlib import Path

import grpc
import pytest

from kvmesh.suite.launcher import ServiceProcess
from kvmesh.v1 import cache_manager_pb2 as cm
from kvmesh.v1 import cache_manager_pb2_grpc as cm_grpc
from kvmesh.v1 import common_pb2, worker_pb2, worker_pb2_grpc
from tests.support.scrape import metric

pytestmark = pytest.mark.integration
BS = 16
MODEL = "sim-warm-model"
TEMPLATE = list(range(1000, 1000 + 3 * BS))  # 3 blocks, on every worker (replicas 0)
P1 = list(range(2000, 2000 + 4 * BS + 3))  # 4 full blocks each
P2 = list(range(3000, 3000 + 4 * BS + 3))
P3 = list(range(4000, 4000 + 2 * BS))


async def wait_for(what: str, probe: Callable[[], Awaitable[bool]], timeout: float = 20.0) -> None:
    """Poll `probe` (bounded in time) until it is true; fail with `what` otherwise."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout
    while not await probe():
        if loop.time() > deadline:
            pytest.fail(f"timed out waiting for {what}")
        await asyncio.sleep(0.05)  # bounded poll of another process's eventual state


async def test_static_dynamic_and_manual_warming(services: Callable[..., ServiceProcess], tmp_path: Path) -> None:
    tpl = tmp_path / "templates.json"
    tpl.write_text(json.dumps({"templates": [{"name": "sys", "token_ids": TEMPLATE, "replicas": 0}]}))
    cmp = services(
        "cache-manager",
        "--block-size",
        str(BS),
        "--model",
        MODEL,
        "--checkpoint-interval-s",
        "0",
        "--warm-interval-s",
        "0.2",
        "--warm-threshold",
        "5",
        "--warm-templates",
        str(tpl),
    )
    workers = [
        services(
            "worker",
            "--engine",
            "sim",
            "--model",
            MODEL,
            "--block-size",
            str(BS),
            "--kv-blocks",
            "512",
            "--sim-speed",
            "0",
            "--cache-manager",
            cmp.address,
        )
        for _ in range(3)
    ]
    async with grpc.aio.insecure_channel(cmp.address) as cch:
        cs = cm_grpc.CacheManagerServiceStub(cch)

        async def stats() -> cm.GetStatsResponse:
            return await cs.GetStats(cm.GetStatsRequest(), timeout=5)

        async def pairs_are(n: int) -> bool:
            return (await stats()).pairs == n

        async def find(ids: list[int]) -> dict[str, int]:
            r = await cs.FindMatches(
                cm.FindMatchesRequest(token_ids=common_pb2.TokenIds(ids=ids), model=MODEL), timeout=5
            )
            return {m.worker_id: m.matched_blocks for m in r.matches}

        wids = []
        for w in workers:
            async with grpc.aio.insecure_channel(w.address) as wch:
                wids.append(
                    (
                        await worker_pb2_grpc.WorkerServiceStub(wch).GetInfo(worker_pb2.GetInfoRequest(), timeout=5)
                    ).worker_id
                )

        async def generate(i: int, ids: list[int]) -> None:
            async with grpc.aio.insecure_channel(workers[i].address) as wch:
                req = worker_pb2.GenerateRequest(
                    request_id=f"r-{ids[0]}",
                    token_ids=common_pb2.TokenIds(ids=ids),
                    sampling=common_pb2.SamplingParams(max_tokens=1),
                )
                [m async for m in worker_pb2_grpc.WorkerServiceStub(wch).Generate(req, timeout=10)]

        # static: the template file's prefix is preloaded onto all 3 workers as they register
        await wait_for("templates on 3 workers", lambda: pairs_are(3 * 3))
        assert await find(TEMPLATE) == {w: 3 for w in wids}
        assert (await stats()).warming_actions_total == 3

        # dynamic: P1 cached on worker 0, queried 5 times (threshold 5) -> warmed onto one more worker
        await generate(0, P1)
        await wait_for("P1 indexed on worker 0", lambda: pairs_are(9 + 4))
        for _ in range(5):
            assert await find(P1) == {wids[0]: 4}
        await wait_for("P1 warmed onto a second worker", lambda: pairs_are(9 + 8))
        got = await find(P1)
        assert len(got) == 2 and wids[0] in got and set(got.values()) == {4}
        assert (await stats()).warming_actions_total == 4

        # SetWarmingPolicy: validation, then threshold 3 and at most 2 replicas
        for bad in (
            cm.WarmingPolicy(lfu_weight=1.5),
            cm.WarmingPolicy(lfu_weight=-0.1),
            cm.WarmingPolicy(window_s=-1.0),
        ):
            with pytest.raises(grpc.aio.AioRpcError) as ei:
                await cs.SetWarmingPolicy(cm.SetWarmingPolicyRequest(policy=bad), timeout=5)
            assert ei.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        pol = (
            await cs.SetWarmingPolicy(
                cm.SetWarmingPolicyRequest(policy=cm.WarmingPolicy(hot_threshold=3, max_replicas=2, lfu_weight=0.75)),
                timeout=5,
            )
        ).policy
        assert (pol.hot_threshold, pol.max_replicas, pol.window_s, pol.lfu_weight) == (3, 2, 60.0, 0.75)
        await generate(1, P2)
        await wait_for("P2 indexed on worker 1", lambda: pairs_are(17 + 4))
        for _ in range(3):  # below the old threshold of 5: only the new one makes it hot
            assert await find(P2) == {wids[1]: 4}
        await wait_for("P2 warmed onto a second worker", lambda: pairs_are(21 + 4))
        got = await find(P2)
        assert len(got) == 2 and wids[1] in got and set(got.values()) == {4}
        assert (await stats()).warming_actions_total == 5  # P1 stays at max_replicas = 2

        # WarmPrefixes: on demand, 2 replicas of a prefix nobody holds
        with pytest.raises(grpc.aio.AioRpcError) as ei:
            await cs.WarmPrefixes(cm.WarmPrefixesRequest(), timeout=5)
        assert ei.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        r = await cs.WarmPrefixes(cm.WarmPrefixesRequest(prompts=[common_pb2.TokenIds(ids=P3)], replicas=2), timeout=30)
        assert r.requests_issued == 2
        await wait_for("P3 on two workers", lambda: pairs_are(25 + 4))
        got = await find(P3)
        assert len(got) == 2 and set(got.values()) == {2}

    # every warming action was one prefill-only request on a worker, and the metrics count them by reason
    assert metric(cmp.http_port, "kvmesh_cache_warming_actions_total", 'reason="static"') == 3
    assert metric(cmp.http_port, "kvmesh_cache_warming_actions_total", 'reason="dynamic"') == 2
    assert metric(cmp.http_port, "kvmesh_cache_warming_actions_total", 'reason="manual"') == 2
    prefill_only = sum(
        metric(w.http_port, "kvmesh_worker_requests_total", 'finish_reason="prefill_only"') for w in workers
    )
    assert prefill_only == 7
