"""Real sim worker processes with host tiers and peer pulls on 127.0.0.1: a prefix the pool evicted comes
back from the CPU tier as cached tokens; worker B pulls a prefix from worker A through the pull hint (A's
KvSyncService, over shared memory and over gRPC) with the same output; a corrupted peer block, a dead peer
and a void hint end in a recompute with the same output."""

from __future__ import annotations

import asyncio
import mmap
import time
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import grpc
import httpx
import pytest
import pytest_asyncio

from kvmesh.kvplane.kvsync.tier import data_offset
from kvmesh.suite.launcher import ServiceProcess
from kvmesh.v1 import worker_pb2, worker_pb2_grpc
from tests.support.sim_worker import BS, gen_req, start_sim_worker

pytestmark = pytest.mark.integration
TIER = ("--sim-speed", "0", "--cpu-tier-mb", "4")
PREFIX = list(range(300, 300 + 12 * BS))


def start(tmp: Path, *flags: str) -> ServiceProcess:
    return start_sim_worker(tmp, *TIER, *flags)


@pytest.fixture(scope="module")
def worker_a(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServiceProcess]:
    sp = start(tmp_path_factory.mktemp("a"), "--kv-blocks", "40")
    yield sp
    assert sp.terminate(timeout=30) == 0


@pytest_asyncio.fixture
async def stub_a(worker_a: ServiceProcess) -> AsyncIterator[worker_pb2_grpc.WorkerServiceStub]:
    async with grpc.aio.insecure_channel(worker_a.address) as ch:
        yield worker_pb2_grpc.WorkerServiceStub(ch)


async def run(stub: worker_pb2_grpc.WorkerServiceStub, req: worker_pb2.GenerateRequest) -> tuple[list[int], int]:
    msgs = [m async for m in stub.Generate(req, timeout=30)]
    return [t for m in msgs for t in m.token_ids], msgs[-1].usage.cached_tokens


def hint_of(info: worker_pb2.GetInfoResponse, blocks: int, **kw: object) -> worker_pb2.KvPullHint:
    return worker_pb2.KvPullHint(
        source_worker_id=info.worker_id,
        source_address=info.kvsync_address,
        region=info.tier_region,
        region_shm_name=info.tier_shm_name,
        num_blocks=blocks,
        **kw,  # type: ignore[arg-type]
    )


async def test_an_evicted_prefix_comes_back_from_the_cpu_tier(stub_a: worker_pb2_grpc.WorkerServiceStub) -> None:
    info = await stub_a.GetInfo(worker_pb2.GetInfoRequest(), timeout=5)
    assert info.kvsync_address and info.tier_region == "cpu" and info.tier_shm_name and info.tier_blocks_total > 0
    events = stub_a.StreamKvEvents(worker_pb2.StreamKvEventsRequest(), timeout=30)
    prompt = [*range(1, 1 + 10 * BS), 9]
    first, cached = await run(stub_a, gen_req("t1", prompt, max_tokens=4))
    assert cached == 0
    await run(stub_a, gen_req("t2", list(range(5000, 5000 + 30 * BS)), max_tokens=1))  # evicts t1's blocks
    again, cached = await run(stub_a, gen_req("t3", prompt, max_tokens=4))
    assert again == first and cached == 10 * BS
    media: set[str] = set()
    for _ in range(200):  # bounded: the batches of three requests
        msg = await events.read()
        for e in msg.batch.events:
            media.add(e.block_stored.medium if e.HasField("block_stored") else e.block_removed.medium)
        if {"GPU", "CPU"} <= media:
            break
    events.cancel()
    assert {"GPU", "CPU"} <= media


@pytest.mark.parametrize("over_shm", ["true", "false"])
async def test_b_pulls_a_prefix_from_a_with_the_same_output(
    tmp_path: Path, stub_a: worker_pb2_grpc.WorkerServiceStub, over_shm: str
) -> None:
    info = await stub_a.GetInfo(worker_pb2.GetInfoRequest(), timeout=5)
    prompt = [*PREFIX, 1, 2, 3]
    want, _ = await run(stub_a, gen_req(f"a-{over_shm}", prompt, max_tokens=6))
    b = start(tmp_path, "--pull-over-shm", over_shm)
    try:
        async with grpc.aio.insecure_channel(b.address) as ch:
            stub_b = worker_pb2_grpc.WorkerServiceStub(ch)
            req = gen_req("b1", prompt, max_tokens=6, kv_pull=hint_of(info, 12))
            got, cached = await run(stub_b, req)
            assert got == want and cached == 12 * BS
    finally:
        assert b.terminate(timeout=30) == 0


async def test_two_concurrent_requests_pull_the_prefix_once(
    tmp_path: Path, stub_a: worker_pb2_grpc.WorkerServiceStub
) -> None:
    info = await stub_a.GetInfo(worker_pb2.GetInfoRequest(), timeout=5)
    prompt = [*range(11000, 11000 + 12 * BS), 1]
    want, _ = await run(stub_a, gen_req("d0", prompt, max_tokens=4))
    b = start(tmp_path)
    try:
        async with grpc.aio.insecure_channel(b.address) as ch:
            stub_b = worker_pb2_grpc.WorkerServiceStub(ch)
            reqs = [gen_req(f"d{i}", prompt, max_tokens=4, kv_pull=hint_of(info, 12)) for i in (1, 2)]
            results = await asyncio.gather(*(run(stub_b, r) for r in reqs))
            assert results == [(want, 12 * BS)] * 2
            load = stub_b.StreamLoad(worker_pb2.StreamLoadRequest(interval_ms=50), timeout=10)
            await load.read()  # the worker refreshes its gauges with each report
            load.cancel()
        metrics = httpx.get(f"http://127.0.0.1:{b.http_port}/metrics", timeout=10).text
        pulled = [ln for ln in metrics.splitlines() if ln.startswith("kvmesh_worker_tier_pulled_blocks ")]
        assert pulled and float(pulled[0].split()[1]) == 12  # one pull of 12 blocks, not two
    finally:
        assert b.terminate(timeout=30) == 0


async def test_corrupt_block_dead_peer_and_void_hint_recompute(
    tmp_path: Path, stub_a: worker_pb2_grpc.WorkerServiceStub
) -> None:
    info = await stub_a.GetInfo(worker_pb2.GetInfoRequest(), timeout=5)
    prompt = [*range(7000, 7000 + 8 * BS), 4]
    want, _ = await run(stub_a, gen_req("c0", prompt, max_tokens=6))
    with open(f"/dev/shm/{info.tier_shm_name.lstrip('/')}", "r+b") as f, mmap.mmap(f.fileno(), 0) as seg:
        base = data_offset(int(info.tier_blocks_total))
        slot_bytes = 512 * BS  # the tiny model's bytes per block at BS tokens
        for slot in range(int(info.tier_blocks_total)):  # a flipped byte in every block A holds
            seg[base + slot * slot_bytes + 5] ^= 0x40
    b = start(tmp_path)
    try:
        async with grpc.aio.insecure_channel(b.address) as ch:
            stub_b = worker_pb2_grpc.WorkerServiceStub(ch)
            got, cached = await run(stub_b, gen_req("c1", prompt, max_tokens=6, kv_pull=hint_of(info, 8)))
            assert got == want and cached == 0
            dead = worker_pb2.KvPullHint(source_address="127.0.0.1:1", region="cpu", num_blocks=8, timeout_ms=500)
            t0 = time.monotonic()
            other = [*range(8000, 8000 + 8 * BS), 4]
            want2, _ = await run(stub_a, gen_req("c2a", other, max_tokens=6))
            got, cached = await run(stub_b, gen_req("c2", other, max_tokens=6, kv_pull=dead))
            assert got == want2 and cached == 0 and time.monotonic() - t0 < 10
            void = hint_of(info, 8, expires_unix_ms=int(time.time() * 1000) - 1000)
            got, cached = await run(stub_b, gen_req("c3", [*range(9000, 9000 + 8 * BS), 4], max_tokens=6, kv_pull=void))
            assert cached == 0 and len(got) == 6
    finally:
        assert b.terminate(timeout=30) == 0
