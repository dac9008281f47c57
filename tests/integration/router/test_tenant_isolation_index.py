"""Two tenants send the same prompt to one simulated worker; the cache-manager's index (FindMatches with
tenant A, tenant B, no tenant) shows each tenant only the blocks computed under its own cache salt."""

from __future__ import annotations

import asyncio
from collections.abc import Callable

import grpc
import pytest

from kvmesh.suite.launcher import ServiceProcess
from kvmesh.v1 import cache_manager_pb2 as cm
from kvmesh.v1 import cache_manager_pb2_grpc as cm_grpc
from kvmesh.v1 import common_pb2, worker_pb2, worker_pb2_grpc

pytestmark = pytest.mark.integration
BS = 16
MODEL = "sim-tenant-model"


async def find(stub: cm_grpc.CacheManagerServiceStub, ids: list[int], tenant: str) -> dict[str, int]:
    r = await stub.FindMatches(
        cm.FindMatchesRequest(token_ids=common_pb2.TokenIds(ids=ids), model=MODEL, tenant=tenant), timeout=5
    )
    return {m.worker_id: m.matched_blocks for m in r.matches}


async def until(
    stub: cm_grpc.CacheManagerServiceStub, ids: list[int], tenant: str, want: dict[str, int], timeout: float = 15.0
) -> dict[str, int]:
    """FindMatches polled (bounded) until it equals `want`; returns the last answer."""
    got: dict[str, int] = {}
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout
    while loop.time() < deadline:
        got = await find(stub, ids, tenant)
        if got == want:
            break
        await asyncio.sleep(0.05)  # bounded poll of another process's eventual state
    return got


async def generate(stub: worker_pb2_grpc.WorkerServiceStub, rid: str, ids: list[int], tenant: str) -> None:
    req = worker_pb2.GenerateRequest(
        request_id=rid,
        token_ids=common_pb2.TokenIds(ids=ids),
        tenant=tenant,
        sampling=common_pb2.SamplingParams(max_tokens=1),
    )
    [m async for m in stub.Generate(req, timeout=10)]


async def test_tenants_see_only_their_own_blocks(services: Callable[..., ServiceProcess]) -> None:
    cmp = services(
        "cache-manager",
        "--block-size",
        str(BS),
        "--model",
        MODEL,
        "--checkpoint-interval-s",
        "0",
        "--warm-interval-s",
        "0",
    )
    w = services(
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
    prompt = list(range(10, 10 + 4 * BS + 3))  # 4 full blocks
    async with grpc.aio.insecure_channel(w.address) as wch, grpc.aio.insecure_channel(cmp.address) as cch:
        ws = worker_pb2_grpc.WorkerServiceStub(wch)
        cs = cm_grpc.CacheManagerServiceStub(cch)
        wid = (await ws.GetInfo(worker_pb2.GetInfoRequest(), timeout=5)).worker_id
        await generate(ws, "a1", prompt, "tenant-a")
        assert await until(cs, prompt, "tenant-a", {wid: 4}) == {wid: 4}
        assert await find(cs, prompt, "tenant-b") == {}
        assert await find(cs, prompt, "") == {}
        await generate(ws, "b1", prompt[: 2 * BS], "tenant-b")  # B computes its own copy of 2 blocks
        assert await until(cs, prompt, "tenant-b", {wid: 2}) == {wid: 2}
        assert await find(cs, prompt, "tenant-a") == {wid: 4}
        assert await find(cs, prompt, "") == {}
        await generate(ws, "n1", prompt[:BS], "")  # no tenant: the plain (model-only) salt
        assert await until(cs, prompt, "", {wid: 1}) == {wid: 1}
        assert await find(cs, prompt, "tenant-a") == {wid: 4}
        assert await find(cs, prompt, "tenant-b") == {wid: 2}
