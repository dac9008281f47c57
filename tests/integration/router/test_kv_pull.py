"""The router hints a pull, end to end (real router, cache-manager and two sim workers with CPU tiers on
127.0.0.1): the worker holding a long prefix is drained, the next request with that prefix goes to the other
worker with a pull hint, which pulls the prefix from the drained one's tier: cached tokens, the same output.
A prefix that only the holder's CPU tier keeps is priced as a tier load there (the router's replica knows the
medium), and pulled from that tier once the holder is drained."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from functools import partial

import grpc
import httpx
import pytest

from kvmesh.core.config import ServerSettings
from kvmesh.index import hashing
from kvmesh.services.router.index_replica import IndexReplica
from kvmesh.suite.launcher import ServiceProcess
from kvmesh.v1 import common_pb2, router_pb2, router_pb2_grpc, worker_pb2, worker_pb2_grpc
from tests.integration.router.test_e2e import BS, _wait_for_holder, gen, start_router, stream, toks
from tests.support.procs import start_together

pytestmark = pytest.mark.integration


def test_a_drained_holder_s_prefix_is_pulled_by_the_other_worker(services: Callable[..., ServiceProcess]) -> None:
    cm = services("cache-manager", "--block-size", str(BS), "--model", "tiny")
    flags = ["--engine", "sim", "--block-size", str(BS), "--kv-blocks", "4096", "--sim-speed", "0"]
    workers = start_together(
        *[partial(services, "worker", *flags, "--cpu-tier-mb", "8", "--cache-manager", cm.address)] * 2
    )
    router = start_router(services, workers, "--cache-manager", cm.address, "--salt-model", "tiny")
    prompt = toks(40 * BS, 100)
    first = list(stream(router.address, gen(prompt, 6), key=None))
    home = first[-1].worker_id
    _wait_for_holder(cm.address, prompt, home, blocks=40)
    with grpc.insecure_channel(router.address) as ch:
        admin = router_pb2_grpc.RouterAdminServiceStub(ch)
        admin.DrainWorker(router_pb2.DrainWorkerRequest(worker_id=home, drain=True))
    second = list(stream(router.address, gen(prompt, 6), key=None))
    assert second[-1].worker_id != home
    assert second[-1].usage.cached_tokens == 39 * BS  # every block but the last token's, pulled from `home`
    assert [t for m in second for t in m.token_ids] == [t for m in first for t in m.token_ids]


def _metric(router: ServiceProcess, name: str, labels: str = "") -> float:
    """One sample of the router's /metrics (0 when absent)."""
    text = httpx.get(f"http://127.0.0.1:{router.http_port}/metrics", timeout=10).text
    for line in text.splitlines():
        if line.startswith(f"{name}{labels} "):
            return float(line.split()[-1])
    return 0.0


def _info(worker: ServiceProcess) -> worker_pb2.GetInfoResponse:
    with grpc.insecure_channel(worker.address) as ch:
        return worker_pb2_grpc.WorkerServiceStub(ch).GetInfo(worker_pb2.GetInfoRequest(), timeout=10)


def _generate_on(worker: ServiceProcess, rid: str, prompt: list[int]) -> None:
    """A request straight to one worker (it must hold another prompt, so the first one leaves its GPU)."""
    req = worker_pb2.GenerateRequest(
        request_id=rid,
        token_ids=common_pb2.TokenIds(ids=prompt),
        sampling=common_pb2.SamplingParams(max_tokens=2, ignore_eos=True),
    )
    with grpc.insecure_channel(worker.address) as ch:
        assert list(worker_pb2_grpc.WorkerServiceStub(ch).Generate(req, timeout=30))


async def _tier_only_pairs(cm: str, prompt: list[int], home: str) -> int:
    """Waits (bounded, on replica updates) until a replica of `cm` sees `prompt` only in `home`'s tier; returns
    the tier-only (worker, block) pairs it knows then (the router's replica must reach the same)."""
    replica = IndexReplica(cm, ServerSettings())
    hashes = hashing.compute_block_hashes(prompt, BS, int(hashing.make_salt("tiny")))
    await replica.start()
    try:
        await asyncio.wait_for(replica.synced.wait(), 10)

        async def held_in_tier() -> bool:
            found = await replica.lookup(hashes)
            return found.total.get(home, 0) == len(prompt) // BS and found.gpu.get(home, 0) == 0

        async def loop() -> None:
            while not await held_in_tier():
                replica.updated.clear()
                await replica.updated.wait()

        await asyncio.wait_for(loop(), 60)
        return replica.tier_pairs()
    finally:
        await replica.stop()


async def test_a_prefix_only_in_a_cpu_tier_is_priced_as_a_load_there_then_pulled_from_it(
    services: Callable[..., ServiceProcess],
) -> None:
    cm = services("cache-manager", "--block-size", str(BS), "--model", "tiny")
    flags = ["--engine", "sim", "--block-size", str(BS), "--kv-blocks", "64", "--sim-speed", "0"]
    workers = start_together(
        *[partial(services, "worker", *flags, "--cpu-tier-mb", "8", "--cache-manager", cm.address)] * 2
    )
    router = start_router(services, workers, "--cache-manager", cm.address, "--salt-model", "tiny")
    prompt = toks(40 * BS, 100)
    first = list(stream(router.address, gen(prompt, 6), key=None))
    home = first[-1].worker_id
    holder = next(w for w in workers if _info(w).worker_id == home)
    t = _info(holder).transfer  # the sim's perf model: what the router prices loads and pulls with
    assert 0 < t.block_load_s < BS * t.prefill_s_per_token and t.block_pull_s > 0 and t.pull_rtt_s > 0
    for i, start in enumerate((300, 500)):  # two other 40-block prompts: the first one leaves home's GPU pool
        _generate_on(holder, f"evict-{i}", toks(40 * BS, start))
    pairs = await _tier_only_pairs(cm.address, prompt, home)
    deadline = time.monotonic() + 30
    while _metric(router, "kvmesh_router_index_tier_only_blocks") != pairs:  # the router's replica caught up
        assert time.monotonic() < deadline, "the router's replica never saw the tier-only blocks"
        await asyncio.sleep(0.02)  # bounded poll of another process's state

    loads = _metric(router, "kvmesh_router_prefix_blocks_total", '{source="load"}')
    gpus = _metric(router, "kvmesh_router_prefix_blocks_total", '{source="gpu"}')
    again = list(stream(router.address, gen(prompt, 6), key=None))
    assert again[-1].worker_id == home  # its CPU tier is priced as a load: cheaper than recomputing elsewhere
    assert _metric(router, "kvmesh_router_prefix_blocks_total", '{source="load"}') - loads == 40
    assert _metric(router, "kvmesh_router_prefix_blocks_total", '{source="gpu"}') == gpus
    assert again[-1].usage.cached_tokens == 39 * BS  # loaded from home's tier (the last token's block computed)
    assert [t for m in again for t in m.token_ids] == [t for m in first for t in m.token_ids]

    for i, start in enumerate((300, 500)):  # home's GPU pool gives the prompt up again
        _generate_on(holder, f"evict-again-{i}", toks(40 * BS, start))
    await _tier_only_pairs(cm.address, prompt, home)
    with grpc.insecure_channel(router.address) as ch:
        admin = router_pb2_grpc.RouterAdminServiceStub(ch)
        admin.DrainWorker(router_pb2.DrainWorkerRequest(worker_id=home, drain=True))
    sent = _metric(router, "kvmesh_router_kv_pull_hints_total", '{outcome="sent"}')
    third = list(stream(router.address, gen(prompt, 6), key=None))
    assert third[-1].worker_id != home
    assert _metric(router, "kvmesh_router_kv_pull_hints_total", '{outcome="sent"}') == sent + 1
    assert third[-1].usage.cached_tokens == 39 * BS  # pulled from home's CPU tier
    assert [t for m in third for t in m.token_ids] == [t for m in first for t in m.token_ids]


def test_a_worker_without_a_tier_reports_no_transfer_costs(services: Callable[..., ServiceProcess]) -> None:
    w = services("worker", "--engine", "sim", "--block-size", str(BS), "--kv-blocks", "64", "--cpu-tier-mb", "0")
    info = _info(w)
    assert not info.kvsync_address and not info.HasField("transfer")  # no data plane: never a source or a puller
