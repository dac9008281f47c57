"""A vLLM worker's pull hint, without vLLM: the source worker serves its connector's tier attached read-only
(`vllm_tier_server`) over loopback gRPC; `VllmPulls` leases the prefix there and returns the connector's
params; the lease lands in the region's lease array, where the owner sees it. A region not on this host, a
dead source and an expired hint are no pull."""

from __future__ import annotations

import hashlib
import os
import time
from collections.abc import AsyncIterator
from typing import Any, cast

import pytest
import pytest_asyncio

from kvmesh.engine.base import EngineRequest
from kvmesh.engine.sim.tiers import PullHint
from kvmesh.kvsync.tier import TierRegion
from kvmesh.services.worker.kvpull import KvSyncServer, PeerPulls, VllmPulls, vllm_tier_server
from kvmesh.services.worker.settings import WorkerSettings
from kvmesh.vllm_connector.plan import parse_pull_hint

pytestmark = pytest.mark.integration
BLOCK = 4096
REQ = EngineRequest("r1", (1, 2, 3))


def _digest(i: int) -> bytes:
    return hashlib.sha256(f"blk-{i}".encode()).digest()


@pytest_asyncio.fixture
async def source() -> AsyncIterator[tuple[TierRegion, KvSyncServer, str]]:
    owner = TierRegion.create(f"kvmesh-it-{os.getpid()}-{os.urandom(4).hex()}", BLOCK, 8, "test-layout")
    for i in range(3):
        assert owner.put(_digest(i), bytes([i]) * BLOCK, time.monotonic_ns())
    server = vllm_tier_server(owner.shm_name, WorkerSettings())
    assert server is not None
    address = await server.start()
    yield owner, server, address
    await server.stop()
    owner.close()


@pytest_asyncio.fixture
async def pulls() -> AsyncIterator[VllmPulls]:
    peers = PeerPulls(WorkerSettings(pull_timeout_ms=2000))
    yield VllmPulls(cast(Any, None), peers)  # hints with digests never need the engine
    await peers.close()


def _hint(address: str, shm_name: str, digests: list[bytes], **kw: Any) -> PullHint:
    return PullHint(
        source_address=address, region="cpu", num_blocks=len(digests), shm_name=shm_name, digests=tuple(digests), **kw
    )


async def test_lease_from_the_source_becomes_the_connectors_params(
    source: tuple[TierRegion, KvSyncServer, str], pulls: VllmPulls
) -> None:
    owner, _, address = source
    wanted = [_digest(0), _digest(1), _digest(2), _digest(9)]  # block 9 is not held
    params = await pulls.params(REQ, _hint(address, owner.shm_name, wanted, lease_ms=10_000))
    hint = parse_pull_hint(params)
    assert hint is not None and hint.shm_name == owner.shm_name
    assert hint.digests == frozenset(wanted[:3])
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
    assert await pulls.params(REQ, _hint(address, "kvmesh-it-not-on-this-host", digests)) is None
    t0 = time.monotonic()
    dead = _hint("127.0.0.1:1", owner.shm_name, digests, timeout_ms=500)
    assert await pulls.params(REQ, dead) is None
    assert time.monotonic() - t0 < 2.0  # the hint's deadline bounds it
    expired = _hint(address, owner.shm_name, digests, expires_unix_ms=int(time.time() * 1000) - 1)
    assert await pulls.params(REQ, expired) is None
    assert await pulls.params(REQ, _hint(address, owner.shm_name, [_digest(7)])) is None
    assert pulls.outcomes == {"remote_unsupported": 1, "failed": 1, "expired": 1, "missing": 1}
    assert not owner.leased(_digest(0), time.monotonic_ns())  # nothing was leased
