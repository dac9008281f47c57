"""A vLLM worker's pull, without vLLM: the source worker serves its connector's tier attached read-only
(`KvSyncServer` over a `RegionReader`) over loopback gRPC; `VllmPulls` leases the prefix there and returns
the leased pull (read back here from the connector's params); the lease lands in the region's lease array,
where the owner sees it. A source whose region is not on this host is streamed over gRPC into the worker's
staging region, leased there, and the params name it; a corrupted block, a full staging region, a dead
source and an expired pull are no pull."""

from __future__ import annotations

import asyncio
import hashlib
import os
import time
from collections.abc import AsyncIterator
from typing import Any, cast

import grpc
import pytest
import pytest_asyncio

from kvmesh.core.generation import EngineRequest
from kvmesh.core.pull import KvPull
from kvmesh.engine.vllm_pulls import VllmPulls
from kvmesh.kvplane.kvsync.peer import BreakingKvSync
from kvmesh.kvplane.kvsync.service import add_to_server
from kvmesh.kvplane.kvsync.tier import RegionReader, TierRegion
from kvmesh.kvplane.staging import PullStaging
from kvmesh.kvplane.vllm_connector.layout import KvLayout
from kvmesh.kvplane.vllm_connector.plan import parse_pull, pull_params
from kvmesh.services.worker.kvpull import KvSyncServer, peer_pulls
from kvmesh.services.worker.settings import WorkerSettings
from tests.support.regions import corrupt_block

pytestmark = pytest.mark.integration
LAYOUT = KvLayout("test-model", "torch.bfloat16", block_size=32, num_layers=1, num_kv_heads=1, head_size=32)
BLOCK = LAYOUT.block_bytes  # 4096
ELSEWHERE = "kvmesh-it-not-on-this-host"
REQ = EngineRequest("r1", (1, 2, 3))


def _digest(i: int) -> bytes:
    return hashlib.sha256(f"blk-{i}".encode()).digest()


@pytest_asyncio.fixture
async def source() -> AsyncIterator[tuple[TierRegion, KvSyncServer, str]]:
    owner = TierRegion.create(f"kvmesh-it-{os.getpid()}-{os.urandom(4).hex()}", BLOCK, 8, LAYOUT.describe())
    for i in range(3):
        assert owner.put(_digest(i), bytes([i]) * BLOCK, time.monotonic_ns())
    server = KvSyncServer(RegionReader.attach(owner.shm_name), WorkerSettings())
    address = await server.start()
    yield owner, server, address
    await server.stop()
    owner.close()


@pytest_asyncio.fixture
async def pulls() -> AsyncIterator[VllmPulls]:
    peers = peer_pulls(WorkerSettings(pull_timeout_ms=2000))
    vp = VllmPulls(cast(Any, None), peers, PullStaging(64 * BLOCK), LAYOUT)  # hints with digests need no engine
    yield vp
    vp.close()
    await peers.close()


def _hint(address: str, shm_name: str, digests: list[bytes], **kw: Any) -> KvPull:
    return KvPull(
        source_address=address, region="cpu", num_blocks=len(digests), shm_name=shm_name, digests=tuple(digests), **kw
    )


async def test_lease_from_the_source_becomes_the_connectors_params(
    source: tuple[TierRegion, KvSyncServer, str], pulls: VllmPulls
) -> None:
    owner, _, address = source
    wanted = [_digest(0), _digest(1), _digest(2), _digest(9)]  # block 9 is not held
    params = await _params(pulls, _hint(address, owner.shm_name, wanted, lease_ms=10_000))
    hint = parse_pull(params)
    assert hint is not None and hint.shm_name == owner.shm_name
    assert hint.digests == tuple(wanted[:3])
    now = time.monotonic_ns()
    assert hint.lease_until_ns > now + 5_000_000_000
    for i in range(3):  # the worker (lessor) wrote the lease the owner must respect
        assert owner.leased(_digest(i), now)
        assert not owner.evict(_digest(i), now)
    assert pulls.outcomes == {"leased": 1}


async def test_no_pull_when_the_source_is_elsewhere_dead_or_expired(
    source: tuple[TierRegion, KvSyncServer, str], pulls: VllmPulls
) -> None:
    owner, _, address = source
    digests = [_digest(0)]
    t0 = time.monotonic()
    dead = _hint("127.0.0.1:1", owner.shm_name, digests, timeout_ms=500)
    assert await _params(pulls, dead) is None
    assert time.monotonic() - t0 < 2.0  # the hint's deadline bounds it
    expired = _hint(address, owner.shm_name, digests, expires_unix_ms=int(time.time() * 1000) - 1)
    assert await _params(pulls, expired) is None
    assert await _params(pulls, _hint(address, owner.shm_name, [_digest(7)])) is None
    dead_remote = _hint("127.0.0.1:1", ELSEWHERE, digests, timeout_ms=500)
    assert await _params(pulls, dead_remote) is None
    assert pulls.outcomes == {"failed": 2, "expired": 1, "missing": 1}
    assert not owner.leased(_digest(0), time.monotonic_ns())  # nothing was leased
    no_staging = VllmPulls(cast(Any, None), pulls.peers, PullStaging(0), LAYOUT)
    assert await _params(no_staging, _hint(address, ELSEWHERE, digests)) is None
    assert no_staging.outcomes == {"remote_unsupported": 1}


async def _params(pulls: VllmPulls, pull: KvPull) -> dict[str, Any] | None:
    """The connector's `kv_transfer_params` of the request's pull (None: no pull)."""
    return pull_params((await pulls.arrange(REQ, pull)).load)


def _staged(params: dict[str, Any] | None) -> tuple[str, tuple[bytes, ...], int]:
    hint = parse_pull(params)
    assert hint is not None
    return hint.shm_name, hint.digests, hint.lease_until_ns


async def test_a_source_on_another_host_is_streamed_into_staging(
    source: tuple[TierRegion, KvSyncServer, str], pulls: VllmPulls
) -> None:
    owner, _, address = source
    wanted = [_digest(0), _digest(1), _digest(2), _digest(9)]
    name, offered, until = _staged(await _params(pulls, _hint(address, ELSEWHERE, wanted, lease_ms=10_000)))
    staging = pulls.staging.region
    assert staging is not None and name == staging.shm_name != owner.shm_name
    assert offered == tuple(wanted[:3])
    now = time.monotonic_ns()
    assert until > now + 5_000_000_000
    reader = RegionReader.attach(name, expect_layout=LAYOUT.describe())  # as the connector attaches it
    try:
        for i, ref in enumerate(reader.locate(wanted[:3])):
            assert ref is not None and staging.lease_until(ref.slot) == until
            out = bytearray(BLOCK)
            assert reader.read_into(ref, _digest(i), memoryview(out)) == BLOCK
            assert bytes(out) == bytes([i]) * BLOCK
    finally:
        reader.close()
    assert pulls.outcomes == {"remote": 1}
    pulls.close()
    assert not os.path.exists(f"/dev/shm/{name}")  # unlinked on close


async def test_a_forced_grpc_pull_a_corrupt_block_and_a_full_staging_region(
    source: tuple[TierRegion, KvSyncServer, str],
) -> None:
    owner, _, address = source
    peers = peer_pulls(WorkerSettings(pull_timeout_ms=2000, pull_over_shm=False))
    pulls = VllmPulls(cast(Any, None), peers, PullStaging(2 * BLOCK), LAYOUT)  # two slots
    try:
        wanted = [_digest(0), _digest(1), _digest(2)]
        name, offered, _ = _staged(await _params(pulls, _hint(address, owner.shm_name, wanted)))
        assert pulls.staging.region is not None and name == pulls.staging.region.shm_name  # not the source's
        assert offered == tuple(wanted[:2])  # as many as the staging region holds
        assert await _params(pulls, _hint(address, ELSEWHERE, [_digest(2)])) is None  # both slots leased
        corrupt_block(owner.shm_name, _digest(2))
        pulls.staging.close()  # a fresh, empty staging region: only the corrupt block stops this one
        assert await _params(pulls, _hint(address, ELSEWHERE, [_digest(2)])) is None
        assert pulls.outcomes == {"remote": 1, "missing": 1, "failed": 1}
    finally:
        pulls.close()
        await peers.close()


async def test_a_corrupt_block_stages_only_the_verified_blocks_before_it(
    source: tuple[TierRegion, KvSyncServer, str], pulls: VllmPulls, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Block 1 of 0..2 is corrupt at the source: block 0 is staged and leased (received straight into its
    reserved slot, published with the receive copy's CRC: no `put`, no second copy), block 1's and block 2's
    reservations are aborted, and the connector is offered block 0 only."""
    owner, _, address = source
    corrupt_block(owner.shm_name, _digest(1))

    def no_put(*args: object, **kwargs: object) -> bool:
        raise AssertionError("the staging path copied a block through TierRegion.put")

    monkeypatch.setattr(TierRegion, "put", no_put)
    wanted = [_digest(0), _digest(1), _digest(2)]
    name, offered, until = _staged(await _params(pulls, _hint(address, ELSEWHERE, wanted, lease_ms=10_000)))
    staging = pulls.staging.region
    assert staging is not None and name == staging.shm_name
    assert offered == tuple(wanted[:1]) and pulls.outcomes == {"remote_partial": 1}
    assert len(staging) == 1 and staging.contains_prefix(wanted) == 1
    reader = RegionReader.attach(name, expect_layout=LAYOUT.describe())
    try:
        refs = reader.locate(wanted)
        assert refs[1:] == [None, None]  # nothing after the first failed block is visible
        assert refs[0] is not None and staging.lease_until(refs[0].slot) == until
        out = bytearray(BLOCK)
        assert reader.read_into(refs[0], _digest(0), memoryview(out)) == BLOCK and bytes(out) == bytes([0]) * BLOCK
    finally:
        reader.close()
    now = time.monotonic_ns()  # the aborted slots are free: 63 more blocks fit beside the leased one
    monkeypatch.undo()
    assert all(staging.put(_digest(100 + i), bytes(BLOCK), now) for i in range(63))
    assert len(staging) == 64 and staging.drain_evicted() == []
    assert staging.put(_digest(200), bytes(BLOCK), now)  # full: evicts an unleased block, never block 0
    (evicted,) = staging.drain_evicted()
    assert staging.contains_prefix([_digest(0)]) == 1 and evicted in {_digest(100 + i) for i in range(63)}


async def test_a_staged_block_is_leased_again_not_pulled_into_a_second_slot(
    source: tuple[TierRegion, KvSyncServer, str], pulls: VllmPulls
) -> None:
    _, _, address = source
    first = _staged(await _params(pulls, _hint(address, ELSEWHERE, [_digest(0)], lease_ms=1_000)))
    second = _staged(await _params(pulls, _hint(address, ELSEWHERE, [_digest(0), _digest(1)], lease_ms=10_000)))
    staging = pulls.staging.region
    assert staging is not None and len(staging) == 2
    assert second[1] == (_digest(0), _digest(1)) and second[2] > first[2]
    for ref in staging.locate([_digest(0), _digest(1)]):
        assert ref is not None and staging.lease_until(ref.slot) == second[2]
    assert pulls.outcomes == {"remote": 2}


@pytest_asyncio.fixture
async def stalling() -> AsyncIterator[tuple[BreakingKvSync, str]]:
    owner = TierRegion.create(f"kvmesh-it-{os.getpid()}-{os.urandom(4).hex()}", BLOCK, 8, LAYOUT.describe())
    for i in range(4):
        assert owner.put(_digest(i), bytes([i]) * BLOCK, time.monotonic_ns())
    servicer = BreakingKvSync({"cpu": owner}, message_bytes=BLOCK, messages=2, stall=True)
    server = grpc.aio.server()
    add_to_server(servicer, server)
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    yield servicer, f"127.0.0.1:{port}"
    await server.stop(None)
    owner.close()


async def test_a_stream_that_stalls_after_two_blocks_stages_those_two(
    stalling: tuple[BreakingKvSync, str], pulls: VllmPulls
) -> None:
    """The stream's deadline ends the pull (before the hint's): the two blocks that arrived verified are
    staged and leased, the other two reservations aborted."""
    _, address = stalling
    wanted = [_digest(i) for i in range(4)]
    t0 = time.monotonic()
    name, offered, until = _staged(await _params(pulls, _hint(address, ELSEWHERE, wanted, timeout_ms=500)))
    assert time.monotonic() - t0 < 2.0
    assert offered == tuple(wanted[:2]) and pulls.outcomes == {"remote_partial": 1}
    staging = pulls.staging.region
    assert staging is not None and len(staging) == 2 and staging.contains_prefix(wanted) == 2
    reader = RegionReader.attach(name)
    try:
        refs = reader.locate(wanted)
        assert refs[2:] == [None, None]
        for i, ref in enumerate(refs[:2]):
            assert ref is not None and staging.lease_until(ref.slot) == until
            out = bytearray(BLOCK)
            assert reader.read_into(ref, _digest(i), memoryview(out)) == BLOCK and bytes(out) == bytes([i]) * BLOCK
    finally:
        reader.close()


async def test_a_cancelled_staging_pull_publishes_nothing_and_frees_every_slot(
    stalling: tuple[BreakingKvSync, str], pulls: VllmPulls
) -> None:
    servicer, address = stalling
    wanted = [_digest(i) for i in range(4)]
    task = asyncio.create_task(_params(pulls, _hint(address, ELSEWHERE, wanted, timeout_ms=10_000)))
    await asyncio.wait_for(servicer.stalled.wait(), 5.0)  # two blocks sent, the stream open
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    staging = pulls.staging.region
    assert staging is not None and len(staging) == 0
    reader = RegionReader.attach(staging.shm_name)
    try:
        assert reader.locate(wanted) == [None] * 4
        assert all(int(g) % 2 == 0 for g in reader._gen)  # no slot left half-written
    finally:
        reader.close()
    now = time.monotonic_ns()
    assert all(staging.put(_digest(100 + i), bytes(BLOCK), now) for i in range(64))  # every slot free
    assert staging.drain_evicted() == []
