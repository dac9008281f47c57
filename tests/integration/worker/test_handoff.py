"""Prefill/decode disaggregation between two real sim worker processes with CPU tiers, over kv-sync: a prefill
worker's prefill half ends with a handoff of the blocks it holds for the decode worker, which pulls them and
answers with the tokens of an aggregated run; the hold then ends as collected, or as expired when no decode
comes, counted in the prefill worker's metrics, and its slots are free again. A void handoff, or a prefill
worker killed before the pull, ends in computing the prompt: the same tokens, within the pull's deadline.
Each role refuses the half it does not run, naming the field."""

from __future__ import annotations

import time
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import grpc
import pytest
import pytest_asyncio

from kvmesh.kvplane.kvsync.tier import RegionReader
from kvmesh.suite.launcher import ServiceProcess
from kvmesh.v1 import worker_pb2
from kvmesh.v1.worker_pb2_grpc import WorkerServiceStub as Stub
from tests.support.poll import wait_until
from tests.support.scrape import metric
from tests.support.sim_worker import BS, gen_req, start_sim_worker

pytestmark = pytest.mark.integration
TIER = ("--sim-speed", "0", "--cpu-tier-mb", "4")
HOLD_CAP_MS = 4000  # the prefill worker's --handoff-hold-ms
PULL_LEASE_MS = 300  # the decode worker's --pull-lease-ms: its lease on the prefill worker's slots


@pytest.fixture(scope="module")
def prefill(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServiceProcess]:
    sp = start_sim_worker(
        tmp_path_factory.mktemp("p"), *TIER, "--role", "prefill", "--handoff-hold-ms", str(HOLD_CAP_MS)
    )
    yield sp
    assert sp.terminate(timeout=30) == 0


@pytest.fixture(scope="module")
def decode(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServiceProcess]:
    sp = start_sim_worker(
        tmp_path_factory.mktemp("d"),
        *TIER,
        "--role",
        "decode",
        "--pull-lease-ms",
        str(PULL_LEASE_MS),
        "--pull-timeout-ms",
        "1000",
    )
    yield sp
    assert sp.terminate(timeout=30) == 0


@pytest_asyncio.fixture
async def stubs(prefill: ServiceProcess, decode: ServiceProcess) -> AsyncIterator[tuple[Stub, Stub]]:
    async with grpc.aio.insecure_channel(prefill.address) as p, grpc.aio.insecure_channel(decode.address) as d:
        yield Stub(p), Stub(d)


def prompt_of(base: int) -> list[int]:
    return [*range(base, base + 12 * BS), 1, 2, 3]  # 12 full blocks before the last token's


async def prefill_half(stub: Stub, rid: str, prompt: list[int], hold_ms: int) -> worker_pb2.KvHandoff:
    """The router's prefill half; returns the handoff of its last response (and checks there are no tokens)."""
    req = gen_req(rid, prompt, max_tokens=1, prefill_only=True, hand_off_ms=hold_ms)
    msgs = [m async for m in stub.Generate(req, timeout=30)]
    assert not any(m.token_ids for m in msgs) and msgs[-1].HasField("handoff")
    assert not any(m.HasField("handoff") for m in msgs[:-1])
    return msgs[-1].handoff


async def decode_half(stub: Stub, rid: str, prompt: list[int], handoff: worker_pb2.KvHandoff) -> tuple[list[int], int]:
    """The router's decode half (the handoff, and its pull as `kv_pull`): (tokens, cached tokens)."""
    req = gen_req(rid, prompt, max_tokens=6, handoff=handoff, kv_pull=handoff.pull)
    msgs = [m async for m in stub.Generate(req, timeout=30)]
    return [t for m in msgs for t in m.token_ids], msgs[-1].usage.cached_tokens


async def aggregated(stub: Stub, rid: str, prompt: list[int]) -> list[int]:
    msgs = [m async for m in stub.Generate(gen_req(rid, prompt, max_tokens=6), timeout=30)]
    return [t for m in msgs for t in m.token_ids]


def latest_lease_ns(info: worker_pb2.GetInfoResponse) -> int:
    """The latest lease end on any slot of the worker's tier (read from its shared memory, this host)."""
    reader = RegionReader.attach(info.tier_shm_name)
    try:
        return max(reader.lease_until(s) for s in range(reader.num_slots))
    finally:
        reader.close()


async def test_decode_worker_collects_the_handoff_with_the_aggregated_tokens(
    stubs: tuple[Stub, Stub], prefill: ServiceProcess, decode: ServiceProcess
) -> None:
    stub_p, stub_d = stubs
    info = await stub_p.GetInfo(worker_pb2.GetInfoRequest(), timeout=5)
    prompt = prompt_of(1000)
    collected0 = metric(prefill.http_port, "kvmesh_worker_handoffs_total", 'outcome="collected"')
    t0 = time.time() * 1000
    h = await prefill_half(stub_p, "c.prefill", prompt, hold_ms=60_000)
    assert (h.num_blocks, h.source_worker_id, h.cached_tokens) == (12, info.worker_id, 0)
    assert t0 + HOLD_CAP_MS <= h.held_until_unix_ms <= time.time() * 1000 + HOLD_CAP_MS  # capped by the worker
    assert (h.pull.source_address, h.pull.region, h.pull.region_shm_name) == (
        info.kvsync_address,
        info.tier_region,
        info.tier_shm_name,
    )
    assert h.pull.num_blocks == 12 and h.pull.expires_unix_ms == h.held_until_unix_ms
    assert metric(prefill.http_port, "kvmesh_worker_handoff_held_blocks") == 12
    assert metric(prefill.http_port, "kvmesh_worker_handoff_holds") == 1

    tokens, cached = await decode_half(stub_d, "c", prompt, h)
    assert cached == 12 * BS and len(tokens) == 6
    assert metric(decode.http_port, "kvmesh_worker_kv_pull_outcomes_total", 'outcome="pulled"') >= 1
    assert metric(prefill.http_port, "kvmesh_worker_handoffs_total", 'outcome="collected"') == collected0 + 1
    assert metric(prefill.http_port, "kvmesh_worker_handoff_holds") == 0
    assert metric(prefill.http_port, "kvmesh_worker_handoff_held_blocks") == 0
    assert metric(prefill.http_port, "kvmesh_worker_handoff_bytes_total") >= 12 * info.tier_block_bytes
    # the hold's lease ended when collected: only the decode worker's short lease is left on the slots
    assert latest_lease_ns(info) <= time.monotonic_ns() + PULL_LEASE_MS * 1_000_000
    assert tokens == await aggregated(stub_d, "c.ref", prompt)


async def test_an_uncollected_hold_expires_and_its_void_handoff_is_computed(
    stubs: tuple[Stub, Stub], prefill: ServiceProcess, decode: ServiceProcess
) -> None:
    stub_p, stub_d = stubs
    info = await stub_p.GetInfo(worker_pb2.GetInfoRequest(), timeout=5)
    prompt = prompt_of(3000)
    expired0 = metric(prefill.http_port, "kvmesh_worker_handoffs_total", 'outcome="expired"')
    h = await prefill_half(stub_p, "e.prefill", prompt, hold_ms=300)
    assert h.num_blocks == 12 and metric(prefill.http_port, "kvmesh_worker_handoff_holds") == 1
    wait_until(lambda: metric(prefill.http_port, "kvmesh_worker_handoffs_total", 'outcome="expired"') == expired0 + 1)
    assert metric(prefill.http_port, "kvmesh_worker_handoff_holds") == 0
    assert metric(prefill.http_port, "kvmesh_worker_handoff_held_blocks") == 0
    assert latest_lease_ns(info) <= time.monotonic_ns()  # no slot of the tier is leased any more: reusable
    # the decode half of that void handoff computes the prompt: no pull, the aggregated tokens
    t0 = time.monotonic()
    tokens, cached = await decode_half(stub_d, "e", prompt, h)
    assert cached == 0 and time.monotonic() - t0 < 5
    assert tokens == await aggregated(stub_d, "e.ref", prompt)


async def test_each_role_refuses_the_half_it_does_not_run(stubs: tuple[Stub, Stub]) -> None:
    stub_p, stub_d = stubs
    handoff = worker_pb2.KvHandoff(num_blocks=2, pull=worker_pb2.KvPullHint(source_address="127.0.0.1:1"))
    for stub, req, field in (
        (stub_d, gen_req("r1", prompt_of(5000), hand_off_ms=1000), "hand_off_ms"),
        (stub_p, gen_req("r2", prompt_of(5000), handoff=handoff), "handoff"),
        (stub_p, gen_req("r3", prompt_of(5000), hand_off_ms=3_600_000), "hand_off_ms"),
    ):
        with pytest.raises(grpc.aio.AioRpcError) as exc:
            [m async for m in stub.Generate(req, timeout=10)]
        assert exc.value.code() == grpc.StatusCode.INVALID_ARGUMENT and field in (exc.value.details() or "")


async def test_a_prefill_worker_killed_before_the_pull_leaves_the_prompt_computed(
    tmp_path: Path, stubs: tuple[Stub, Stub]
) -> None:
    _, stub_d = stubs
    doomed = start_sim_worker(tmp_path, *TIER, "--role", "prefill")
    try:
        async with grpc.aio.insecure_channel(doomed.address) as ch:
            h = await prefill_half(Stub(ch), "k.prefill", prompt_of(7000), hold_ms=10_000)
        assert h.num_blocks == 12
    finally:
        doomed.kill()  # SIGKILL: its KvSyncService is gone with it, its hold never ends there
    t0 = time.monotonic()
    tokens, cached = await decode_half(stub_d, "k", prompt_of(7000), h)
    assert cached == 0 and time.monotonic() - t0 < 5  # bounded by the decode worker's 1 s pull deadline
    assert tokens == await aggregated(stub_d, "k.ref", prompt_of(7000))
