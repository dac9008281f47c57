"""The Mooncake read path: how the process's TE batches are waited for (`MooncakeEngine._read_pieces`, against a
stand-in for TE's batch state machine: what matters is that it neither spins nor returns while a batch can
still write), and the client's checks of what a real TE read landed (one process serving and pulling: TE reads
its own registered region over loopback TCP), block by block in order as on every path."""

from __future__ import annotations

import hashlib
import os
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass

import grpc
import numpy as np
import pytest

from kvmesh.kvplane.kvsync import mooncake as te
from kvmesh.kvplane.kvsync.client import KvSyncClient, PullFailed
from kvmesh.kvplane.kvsync.service import KvSyncServicer, add_to_server
from kvmesh.kvplane.kvsync.tier import TierRegion, checksum, slot_data_offset

BLOCK = 16384
LAYOUT = "test-model|bfloat16|bs32|flat"


class FakeBatches:
    """A stand-in for TE's batch calls (TE itself cannot be told to finish a batch late, or fail one): batch i
    completes `done_after[i]` status checks after its first one, or fails there when `fails[i]`; a submission
    whose index is in `refused` returns 0, as TE's does when it cannot reach the peer. Checking a batch TE has
    freed (after it reported done or failed) is an error, as it is a use after free in TE."""

    def __init__(self, done_after: list[int], fails: set[int] | None = None, refused: set[int] | None = None) -> None:
        self.done_after = done_after
        self.fails = fails or set()
        self.refused = refused or set()
        self.submitted: list[tuple[list[int], list[int], list[int]]] = []
        self.checks: dict[int, int] = {}
        self.freed: set[int] = set()

    def get_rpc_port(self) -> int:
        return 1

    def batch_transfer_async_read(self, session: str, local: list[int], remote: list[int], lengths: list[int]) -> int:
        index = len(self.submitted)
        self.submitted.append((local, remote, lengths))
        return 0 if index in self.refused else 1000 + index

    def transfer_check_status(self, batch: int) -> int:
        assert batch not in self.freed, f"batch {batch} checked after TE freed it"
        index = batch - 1000
        self.checks[index] = self.checks.get(index, 0) + 1
        if self.checks[index] <= self.done_after[index]:
            return 0
        self.freed.add(batch)
        return -1 if index in self.fails else 1

    def still_running(self) -> set[int]:
        return {i for i in range(len(self.submitted)) if i not in self.refused and 1000 + i not in self.freed}


@pytest.mark.unit
def test_each_piece_is_its_own_batch_submitted_before_any_wait_and_all_end_before_it_returns() -> None:
    fake = FakeBatches([3, 0, 7])
    engine = te.MooncakeEngine(fake, "127.0.0.1")
    assert engine._read_pieces("peer:1", [10, 20, 30], [100, 200, 300], [1, 2, 3]) == 0
    # one batch per piece (TE reports a batch's first task only): every piece's status is then known
    assert fake.submitted == [([10], [100], [1]), ([20], [200], [2]), ([30], [300], [3])]
    assert fake.still_running() == set()


@pytest.mark.unit
def test_a_failed_piece_fails_the_read_only_once_no_other_piece_can_still_land() -> None:
    fake = FakeBatches([0, 5, 40], fails={1})
    engine = te.MooncakeEngine(fake, "127.0.0.1")
    assert engine._read_pieces("peer:1", [10, 20, 30], [100, 200, 300], [1, 2, 3]) < 0
    assert fake.still_running() == set()  # piece 2 finished too: nothing writes the buffers after the return


@pytest.mark.unit
def test_a_refused_submission_fails_the_read_after_the_submitted_pieces_end() -> None:
    fake = FakeBatches([4, 0, 0], refused={1})
    engine = te.MooncakeEngine(fake, "127.0.0.1")
    assert engine._read_pieces("peer:1", [10, 20, 30], [100, 200, 300], [1, 2, 3]) < 0
    assert len(fake.submitted) == 2  # nothing more submitted once TE refused one
    assert fake.still_running() == set()


@pytest.mark.unit
def test_waiting_sleeps_between_polls_instead_of_spinning() -> None:
    """TE's own synchronous read checks the batch's status in a tight loop, taking a core from TE's I/O threads
    and the peer; here a batch that takes ~20 ms is checked a bounded number of times (a spin: ~10^5)."""
    fake = FakeBatches([10**9])
    engine = te.MooncakeEngine(fake, "127.0.0.1")
    finish_at = time.monotonic() + 0.02
    real_check = fake.transfer_check_status

    def check(batch: int) -> int:
        if time.monotonic() >= finish_at:
            fake.done_after[0] = 0
        return real_check(batch)

    fake.transfer_check_status = check  # type: ignore[method-assign]
    start = time.monotonic()
    assert engine._read_pieces("peer:1", [10], [100], [1]) == 0
    took = time.monotonic() - start
    assert 0.02 <= took < 0.5
    # pauses of >= POLL_MIN_S, growing with the wait: at most one check per 20 us of it
    assert fake.checks[0] <= took / te.POLL_MIN_S + 1


@pytest.mark.unit
def test_a_batch_that_never_ends_is_given_up_at_tes_own_bound(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(te, "TRANSFER_TIMEOUT_S", 0.05)
    fake = FakeBatches([10**9])
    engine = te.MooncakeEngine(fake, "127.0.0.1")
    start = time.monotonic()
    assert engine._read_pieces("peer:1", [10], [100], [1 << 20]) < 0
    assert time.monotonic() - start < 1.0


@pytest.mark.unit
def test_registered_all_needs_every_buffer_inside_one_registration() -> None:
    engine = te.MooncakeEngine(FakeBatches([]), "127.0.0.1")
    engine._ranges = {1000: 2000, 5000: 6000}
    assert engine.registered_all([1000, 1500, 5000], [500, 500, 1000])
    assert engine.registered_all([], [])
    assert not engine.registered_all([1000, 1900], [500, 200])  # the second runs past its registration's end
    assert not engine.registered_all([1500, 2500], [100, 100])  # the second is in no registration
    assert not engine.registered_all([1900], [200])  # straddles the gap between two registrations


# A real TE: this process serves its region through its TE and pulls from itself over loopback TCP.


@dataclass
class Served:
    client: KvSyncClient
    region: TierRegion
    digests: list[bytes]
    data: list[bytes]


@pytest.fixture
async def served() -> AsyncIterator[Served]:
    engine = te.engine()
    assert engine is not None, "Mooncake's transfer engine does not start here (a required dependency)"
    region = TierRegion.create(f"kvmesh-mcread-{os.getpid()}-{os.urandom(4).hex()}", BLOCK, 16, LAYOUT)
    digests = [hashlib.sha256(f"mc-{i}".encode()).digest() for i in range(8)]
    data = [os.urandom(BLOCK) for _ in digests]
    for digest, block in zip(digests, data, strict=True):
        assert region.put(digest, block, now_ns=1)
    servicer = KvSyncServicer({"cpu": region}, mooncake=True)
    assert servicer.transports("cpu") == ["shm", "mooncake", "grpc"]
    server = grpc.aio.server()
    add_to_server(servicer, server)
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    channel = grpc.aio.insecure_channel(f"127.0.0.1:{port}")
    client = KvSyncClient(channel, timeout_s=10)
    yield Served(client, region, digests, data)
    client.close()
    await channel.close()
    await server.stop(None)
    servicer.close()
    region.close()


def _registered(n: int) -> tuple[np.ndarray, list[memoryview]]:
    """n buffers in one array registered with this process's TE (as a worker's staging region)."""
    engine = te.engine()
    assert engine is not None
    landing = np.zeros(n * BLOCK, dtype=np.uint8)
    engine.register(memoryview(landing.data))
    whole = memoryview(landing.data)
    return landing, [whole[i * BLOCK : (i + 1) * BLOCK] for i in range(n)]


def _unregister(landing: np.ndarray) -> None:
    engine = te.engine()
    assert engine is not None
    engine.unregister(te.Export(engine.session, int(landing.ctypes.data), landing.nbytes))


@pytest.mark.integration
@pytest.mark.parametrize("into", ["registered", "arena"])
async def test_a_mooncake_pull_lands_every_block_checked(served: Served, into: str) -> None:
    landing, outs = _registered(8) if into == "registered" else (None, [memoryview(bytearray(BLOCK)) for _ in range(8)])
    try:
        stats = await served.client.pull("cpu", served.digests, outs, LAYOUT, prefer_shm=False, transport="mooncake")
        assert (stats.transport, stats.blocks, stats.bytes) == ("mooncake", 8, 8 * BLOCK)
        assert [bytes(o) for o in outs] == served.data
        assert stats.crcs == [checksum(block) for block in served.data]  # what a staging region publishes
    finally:
        if landing is not None:
            _unregister(landing)


@pytest.mark.integration
@pytest.mark.parametrize("into", ["registered", "arena"])
async def test_a_slot_reused_under_the_read_delivers_exactly_the_blocks_before_it(served: Served, into: str) -> None:
    landing, outs = _registered(8) if into == "registered" else (None, [memoryview(bytearray(BLOCK)) for _ in range(8)])
    try:
        lease = await served.client.acquire_lease("cpu", served.digests, ttl_ms=30_000)
        # the owner frees block 5's slot regardless of the lease (as in the instant the lease design tolerates:
        # a reuse begun before the lease was visible), so its generation moves
        assert served.region.evict(served.digests[5])
        with pytest.raises(PullFailed) as err:
            await served.client.pull(
                "cpu", served.digests, outs, LAYOUT, prefer_shm=False, transport="mooncake", lease=lease
            )
        assert (err.value.reason, err.value.blocks, err.value.delivered.transport) == ("stale", 5, "mooncake")
        assert [bytes(o) for o in outs[:5]] == served.data[:5]
    finally:
        if landing is not None:
            _unregister(landing)


@pytest.mark.integration
async def test_a_corrupt_block_and_a_short_buffer_each_stop_the_pull_at_their_index(served: Served) -> None:
    landing, outs = _registered(8)
    try:
        (ref,) = served.region.locate([served.digests[6]])
        assert ref is not None
        at = slot_data_offset(BLOCK, served.region.num_slots, ref.slot) + 7
        served.region.segment[at] ^= 0x5A  # one data byte; the CRC32C written with the block stays
        with pytest.raises(PullFailed) as err:
            await served.client.pull("cpu", served.digests, outs, LAYOUT, prefer_shm=False, transport="mooncake")
        assert (err.value.reason, err.value.blocks) == ("corrupt", 6)
        assert [bytes(o) for o in outs[:6]] == served.data[:6]
        served.region.segment[at] ^= 0x5A
        short = [*outs[:2], memoryview(bytearray(BLOCK // 2)), *outs[3:]]  # block 2's buffer cannot hold it
        with pytest.raises(PullFailed) as err:
            await served.client.pull("cpu", served.digests, short, LAYOUT, prefer_shm=False, transport="mooncake")
        assert (err.value.reason, err.value.blocks) == ("protocol", 2)
        assert "larger than its buffer" in str(err.value)
    finally:
        _unregister(landing)


@pytest.mark.unit
@pytest.mark.parametrize(("raw", "seconds"), [("", 30), ("12", 12), ("2", 5), ("+40", 40), ("soon", 30), (" 7 ", 7)])
def test_tes_transfer_timeout_is_read_as_te_reads_it(monkeypatch: pytest.MonkeyPatch, raw: str, seconds: int) -> None:
    monkeypatch.setenv("MC_TRANSFER_TIMEOUT", raw)
    assert te._transfer_timeout_s() == seconds
