"""A worker's pull under a carried lease (`PeerPulls`, over loopback gRPC to a real `KvSyncServicer`): a
lease taken by another client (the replicating cache-manager, next to the source) is read under with no
lease of the pulling worker's own; one that has ended, is for other blocks or another region, or whose slots
moved on, makes the worker lease itself and still pull every block (each outcome counted)."""

from __future__ import annotations

import dataclasses
import os
import time
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass, field

import grpc
import pytest

from kvmesh.core.pull import CarriedLease, KvPull
from kvmesh.engine.sim.tiers import block_payload, sim_layout, tiny_block_bytes
from kvmesh.kvplane.kvsync.client import KvSyncClient
from kvmesh.kvplane.kvsync.service import KvSyncServicer, add_to_server
from kvmesh.kvplane.kvsync.tier import SlotRef, TierRegion
from kvmesh.kvplane.pulls import EXPIRED, MISMATCH, STALE, USED, PeerPulls, PullLimits, carry
from kvmesh.rpc.channel import PLAINTEXT
from kvmesh.rpc.interceptors import InstrumentedServer

pytestmark = pytest.mark.integration
BS = 16
BB = tiny_block_bytes(BS)
LAYOUT = sim_layout("m", BS, BB)
DIGESTS = [os.urandom(32) for _ in range(6)]


@dataclass
class Source:
    address: str
    region: TierRegion
    leases: list[int] = field(default_factory=list)  # blocks of every lease the server granted

    def observe(self, _region: str, digests: Sequence[bytes], _refs: Sequence[SlotRef | None], _until: int) -> None:
        self.leases.append(len(digests))


@pytest.fixture
async def source() -> AsyncIterator[Source]:
    region = TierRegion.create(f"kvmesh-it-carried-{os.getpid()}-{os.urandom(4).hex()}", BB, 32, LAYOUT)
    for d in DIGESTS:
        assert region.put(d, block_payload(d, BB), time.monotonic_ns())
    server = grpc.aio.server()
    src = Source("", region)
    # instrumented as a worker's kv-sync server is: a stale read answers FAILED_PRECONDITION
    add_to_server(KvSyncServicer({"cpu": region}, on_lease=src.observe), InstrumentedServer(server, "kvsync"))
    src.address = f"127.0.0.1:{server.add_insecure_port('127.0.0.1:0')}"
    await server.start()
    try:
        yield src
    finally:
        await server.stop(None)
        region.close()


async def _lease_next_to_the_source(src: Source) -> CarriedLease:
    """What the replicating cache-manager does: a lease of its own, carried (wall-clock end)."""
    async with grpc.aio.insecure_channel(src.address) as ch:
        lease = await KvSyncClient(ch).acquire_lease("cpu", DIGESTS, ttl_ms=10_000)
    return carry(lease, time.time(), time.monotonic())


async def _pull(pulls: PeerPulls, src: Source, carried: CarriedLease | None, digests: list[bytes]) -> int:
    outs = [memoryview(bytearray(BB)) for _ in digests]
    pull = KvPull(source_address=src.address, region="cpu", num_blocks=len(digests), lease=carried)
    stats = await pulls.pull(pull, digests, outs, LAYOUT, 5.0, prefer_shm=False)
    for d, out in zip(digests[: stats.blocks], outs, strict=False):
        assert bytes(out) == block_payload(d, BB)
    return stats.blocks


@pytest.fixture
async def pulls() -> AsyncIterator[PeerPulls]:
    seen: list[str] = []
    p = PeerPulls(PullLimits(5000, 5000, over_shm=False, transport="grpc"), PLAINTEXT, seen.append)
    yield p
    assert sorted(seen) == sorted(p.carried.elements())  # the worker's metric sees each outcome
    await p.close()


async def test_a_carried_lease_is_read_under_with_no_lease_of_the_worker_s_own(
    source: Source, pulls: PeerPulls
) -> None:
    carried = await _lease_next_to_the_source(source)
    assert source.leases == [6]  # the cache-manager's
    assert await _pull(pulls, source, carried, DIGESTS) == 6
    assert source.leases == [6]  # the worker asked for none
    assert await _pull(pulls, source, carried, DIGESTS[2:]) == 4  # the engine held the first two
    assert source.leases == [6] and pulls.carried == {USED: 2}


async def test_an_unfit_carried_lease_makes_the_worker_lease_itself_and_still_pull(
    source: Source, pulls: PeerPulls
) -> None:
    carried = await _lease_next_to_the_source(source)
    ended = dataclasses.replace(carried, expires_unix_ms=int(time.time() * 1000) + 500)  # inside the margin
    other_blocks = dataclasses.replace(carried, digests=tuple(os.urandom(32) for _ in DIGESTS))
    other_region = dataclasses.replace(carried, region_id=os.urandom(16))  # the source restarted since
    cases = [(ended, EXPIRED), (other_blocks, MISMATCH), (other_region, MISMATCH)]
    for i, (lease, outcome) in enumerate(cases):
        assert await _pull(pulls, source, lease, DIGESTS) == 6, outcome
        assert len(source.leases) == 2 + i  # the worker's own lease (ReadBlocks by digest)
    assert pulls.carried == {EXPIRED: 1, MISMATCH: 2}


async def test_a_carried_lease_whose_slots_moved_on_is_leased_again(source: Source, pulls: PeerPulls) -> None:
    carried = await _lease_next_to_the_source(source)
    moved = dataclasses.replace(
        carried, slots=tuple((s[0], s[1] + 2) if s is not None else None for s in carried.slots)
    )  # every slot rewritten since: the server refuses the read as stale before any block
    assert await _pull(pulls, source, moved, DIGESTS) == 6
    assert len(source.leases) == 2 and pulls.carried == {STALE: 1}
