"""SimEngine.pull_prefix with an in-process transport: pulled blocks become cached tokens with the same output;
two concurrent requests for one prefix pull it once; a failing, corrupting, hanging or void pull ends in a
recompute, within its deadline."""

from __future__ import annotations

import asyncio
import time
import uuid
from collections.abc import AsyncIterator, Sequence

import pytest
import pytest_asyncio

from kvmesh.core.generation import EngineOutput, EngineRequest, SamplingParams
from kvmesh.core.pull import KvPull, PullOutcome
from kvmesh.engine.clock import VirtualClock
from kvmesh.engine.sim.core import SimConfig
from kvmesh.engine.sim.driver import PullTransport, SimEngine
from kvmesh.engine.sim.tiers import HostTiers, block_payload, sim_layout, tiny_block_bytes
from kvmesh.kvplane.kvsync.client import PullFailed, PullStats
from kvmesh.kvplane.kvsync.tier import TierRegion
from kvmesh.routing.dataplane import transfer_costs

pytestmark = pytest.mark.unit
BS = 16
BB = tiny_block_bytes(BS)
LAYOUT = sim_layout("m", BS, BB)
HINT = KvPull(source_address="peer:1", region="cpu", num_blocks=64, timeout_ms=500)


class FakePeer:
    """A transport that serves every digest with its payload (or corrupts / fails / hangs)."""

    def __init__(self, mode: str = "ok") -> None:
        self.mode = mode
        self.calls = 0
        self.gate = asyncio.Event()
        self.gate.set()

    async def __call__(self, hint: KvPull, digests: Sequence[bytes], outs: Sequence[memoryview], layout: str) -> int:
        self.calls += 1
        await self.gate.wait()
        if self.mode == "fail":
            raise ConnectionError("peer is gone")
        if self.mode == "hang":
            await asyncio.Event().wait()
        for d, out in zip(digests, outs, strict=True):
            out[:] = block_payload(d, len(out))
        if self.mode == "corrupt":
            outs[2][7] ^= 1
        if self.mode == "partial":  # the stream died after 4 verified blocks; block 5 arrived half
            outs[4][len(outs[4]) // 2 :] = bytes(len(outs[4]) - len(outs[4]) // 2)
            delivered = PullStats("grpc")
            for out in outs[:4]:
                delivered.add(len(out), 0)
            raise PullFailed("unavailable", "stream died", delivered)
        return len(digests)


def engine(transport: PullTransport) -> SimEngine:
    region = TierRegion.create(f"kvm-test-{uuid.uuid4().hex[:12]}", BB, 256, LAYOUT)
    tiers = HostTiers(region, None, LAYOUT, lease_clock_ns=time.monotonic_ns)
    cfg = SimConfig(block_size=BS, num_blocks=256)
    return SimEngine(cfg, clock=VirtualClock(), tiers=tiers, pull_transport=transport)


@pytest_asyncio.fixture
async def peer_and_engine(request: pytest.FixtureRequest) -> AsyncIterator[tuple[FakePeer, SimEngine]]:
    peer = FakePeer(getattr(request, "param", "ok"))
    eng = engine(peer)
    await eng.start()
    yield peer, eng
    await eng.stop()


PROMPT = tuple(range(1, 1 + 10 * BS + 5))


def greq(rid: str) -> EngineRequest:
    return EngineRequest(rid, PROMPT, sampling=SamplingParams(max_tokens=4, temperature=0.0))


async def outputs(eng: SimEngine, req: EngineRequest) -> tuple[list[int], int]:
    outs: list[EngineOutput] = [o async for o in eng.generate(req)]
    assert outs[-1].usage is not None
    return [t for o in outs for t in o.token_ids], outs[-1].usage.cached_tokens


async def reference() -> list[int]:
    eng = engine(FakePeer())
    await eng.start()
    try:
        return (await outputs(eng, greq("ref")))[0]
    finally:
        await eng.stop()


async def test_pulled_prefix_is_cached_with_the_same_output(peer_and_engine: tuple[FakePeer, SimEngine]) -> None:
    peer, eng = peer_and_engine
    assert (await eng.pull_prefix(greq("a"), HINT)).blocks == 10
    toks, cached = await outputs(eng, greq("a"))
    assert cached == 10 * BS and toks == await reference()
    # already here: no pull
    assert await eng.pull_prefix(greq("b"), HINT) == PullOutcome("held") and eng.pulls["held"] == 1
    assert peer.calls == 1


async def test_two_concurrent_requests_pull_once(peer_and_engine: tuple[FakePeer, SimEngine]) -> None:
    peer, eng = peer_and_engine
    peer.gate.clear()
    first = asyncio.create_task(eng.pull_prefix(greq("a"), HINT))
    second = asyncio.create_task(eng.pull_prefix(greq("b"), HINT))
    for _ in range(100):  # bounded: both are waiting on the one transfer
        if eng.pulls["joined"]:
            break
        await asyncio.sleep(0)
    peer.gate.set()
    assert (await first).blocks == 10 and (await second).blocks == 10
    assert peer.calls == 1 and eng.pulls["joined"] == 1


@pytest.mark.parametrize("peer_and_engine", ["fail", "corrupt", "hang"], indirect=True)
async def test_a_failed_pull_ends_in_a_recompute(peer_and_engine: tuple[FakePeer, SimEngine]) -> None:
    peer, eng = peer_and_engine
    t0 = time.monotonic()
    got = (await eng.pull_prefix(greq("a"), HINT)).blocks
    assert time.monotonic() - t0 < 2.0  # the hint's 500 ms deadline, not a hang
    toks, cached = await outputs(eng, greq("a"))
    assert toks == await reference()
    if peer.mode == "corrupt":
        assert got == 2 and cached == 2 * BS and eng.pulls["corrupt"] == 1  # blocks before the bad one kept
    else:
        assert got == 0 and cached == 0


@pytest.mark.parametrize("peer_and_engine", ["partial"], indirect=True)
async def test_a_pull_failing_part_way_keeps_its_verified_leading_blocks(
    peer_and_engine: tuple[FakePeer, SimEngine],
) -> None:
    _, eng = peer_and_engine
    # blocks 0..3; block 4 (half there) and after: never
    assert await eng.pull_prefix(greq("a"), HINT) == PullOutcome("pulled", 4)
    assert eng.pulls["partial"] == 1 and eng.pulls["pulled_blocks"] == 4
    assert eng.pulls["failed"] == eng.pulls["corrupt"] == 0  # block 4 was never offered to the tier
    toks, cached = await outputs(eng, greq("a"))
    assert cached == 4 * BS and toks == await reference()


async def test_a_void_or_mismatched_hint_is_not_followed(peer_and_engine: tuple[FakePeer, SimEngine]) -> None:
    peer, eng = peer_and_engine
    void = KvPull("peer:1", "cpu", 64, expires_unix_ms=int(time.time() * 1000) - 1)
    assert await eng.pull_prefix(greq("a"), void) == PullOutcome("void") and eng.pulls["void"] == 1
    other = KvPull("peer:1", "cpu", 64, digests=(bytes(32),))
    assert await eng.pull_prefix(greq("a"), other) == PullOutcome("mismatch") and eng.pulls["mismatch"] == 1
    assert peer.calls == 0


async def test_the_engine_serves_its_cpu_tier_and_prices_it_from_its_perf_model(
    peer_and_engine: tuple[FakePeer, SimEngine],
) -> None:
    _, eng = peer_and_engine
    assert eng.served_tier() is eng.core.tiers.cpu  # type: ignore[union-attr]
    # the default perf model and links are the data plane's default figures, to the last bit
    assert eng.transfer_costs() == transfer_costs(BS)
    assert SimEngine(SimConfig(block_size=BS)).served_tier() is None  # no tiers: nothing to serve
