"""kv-sync across real processes: a reader process attached to a region, a peer process served over gRPC
(pulled over its socket and over its shared memory), the peer killed with SIGKILL mid-stream; a peer offering
its region through Mooncake's Transfer Engine (a corrupt byte, SIGKILL mid-read, an expired lease, an
unreachable engine falling back to gRPC)."""

from __future__ import annotations

import asyncio
import dataclasses
import hashlib
import json
import os
import signal
import subprocess
import sys
import textwrap
import time
from collections.abc import Iterator

import grpc
import numpy as np
import pytest

from kvmesh.kvplane.kvsync import mooncake
from kvmesh.kvplane.kvsync.client import KvSyncClient, PullFailed
from kvmesh.kvplane.kvsync.peer import LAYOUT, REGION, peer_block, peer_digests
from kvmesh.kvplane.kvsync.tier import RegionReader, TierRegion, slot_data_offset

pytestmark = pytest.mark.integration

STARTUP_S = 60.0


def _digest(i: int) -> bytes:
    return hashlib.sha256(f"block-{i}".encode()).digest()


READER = textwrap.dedent(
    """
    import sys, hashlib
    from kvmesh.kvplane.kvsync.tier import RegionReader, StaleBlock
    name, layout, n = sys.argv[1], sys.argv[2], int(sys.argv[3])
    reader = RegionReader.attach(name, expect_layout=layout)
    digests = [hashlib.sha256(f"block-{i}".encode()).digest() for i in range(n)]
    refs = reader.locate(digests)
    out = memoryview(bytearray(reader.block_bytes))
    for d, ref in zip(digests, refs):
        k = reader.read_into(ref, d, out)
        print(hashlib.sha256(out[:k]).hexdigest(), flush=True)
    sys.stdin.readline()  # the owner reuses slot 0 meanwhile
    try:
        reader.read_into(refs[0], digests[0], out)
        print("read", flush=True)
    except StaleBlock:
        print("stale", flush=True)
    reader.close()
    """
)


def test_reader_in_another_process_copies_and_detects_reuse() -> None:
    region = TierRegion.create(f"kvmesh-itp-{os.getpid()}", 8192, 3, LAYOUT)
    try:
        blocks = [os.urandom(8192) for _ in range(3)]
        for i, data in enumerate(blocks):
            region.put(_digest(i), data, now_ns=1)
        proc = subprocess.Popen(
            [sys.executable, "-c", READER, region.shm_name, LAYOUT, "3"],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
        )
        assert proc.stdout is not None and proc.stdin is not None
        try:
            got = [proc.stdout.readline().strip() for _ in range(3)]
            assert got == [hashlib.sha256(b).hexdigest() for b in blocks]
            assert region.evict(_digest(0))
            assert region.put(_digest(7), os.urandom(8192), now_ns=2)  # the freed slot, a new generation
            proc.stdin.write("go\n")
            proc.stdin.flush()
            assert proc.stdout.readline().strip() == "stale"
            assert proc.wait(timeout=30) == 0
        finally:
            proc.kill()
            proc.wait(timeout=30)
        # the reader's exit did not unlink the owner's region (no resource-tracker ownership taken)
        assert os.path.exists(f"/dev/shm/{region.shm_name.lstrip('/')}")
    finally:
        region.close()


class PeerProcess:
    def __init__(self, *args: str) -> None:
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "kvmesh.kvplane.kvsync.peer", *args], stdout=subprocess.PIPE, text=True
        )
        assert self.proc.stdout is not None
        line = self.proc.stdout.readline()
        if not line:
            raise RuntimeError(f"peer exited with {self.proc.wait(timeout=STARTUP_S)}")
        self.info = json.loads(line)

    def readline(self) -> str:
        assert self.proc.stdout is not None
        return self.proc.stdout.readline().strip()

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait(timeout=30)


@pytest.fixture
def peers() -> Iterator[list[PeerProcess]]:
    started: list[PeerProcess] = []
    yield started
    for p in started:
        p.stop()


async def test_pull_from_a_peer_process_over_grpc_and_shm(peers: list[PeerProcess]) -> None:
    size, n = 32 * 1024, 32
    peer = PeerProcess("--block-bytes", str(size), "--blocks", str(n))
    peers.append(peer)
    channel = grpc.aio.insecure_channel(f"127.0.0.1:{peer.info['port']}")
    client = KvSyncClient(channel, timeout_s=10)
    try:
        want = [peer_block(i, size) for i in range(n)]
        for prefer_shm, transport in ((False, "grpc"), (True, "shm")):
            outs = [memoryview(bytearray(size)) for _ in range(n)]
            stats = await client.pull(REGION, peer_digests(n), outs, LAYOUT, prefer_shm=prefer_shm)
            assert (stats.transport, stats.blocks, stats.bytes) == (transport, n, n * size)
            assert [bytes(o) for o in outs] == want
    finally:
        client.close()
        await channel.close()


async def test_peer_killed_mid_stream_is_a_typed_error_within_the_deadline(peers: list[PeerProcess]) -> None:
    size, n = 1 << 20, 8
    # five messages (128 KiB doubling up to 1 MiB: 2.875 MiB) carry blocks 0 and 1 whole, and part of block 2
    peer = PeerProcess("--block-bytes", str(size), "--blocks", str(n), "--stall-after", "5")
    peers.append(peer)
    channel = grpc.aio.insecure_channel(f"127.0.0.1:{peer.info['port']}")
    client = KvSyncClient(channel)
    try:
        outs = [memoryview(bytearray(size)) for _ in range(n)]
        start = time.monotonic()
        pull = asyncio.create_task(client.pull(REGION, peer_digests(n), outs, LAYOUT, timeout_s=5.0, prefer_shm=False))
        assert await asyncio.to_thread(peer.readline) == "stalled"  # five messages sent, the stream is open
        want = [peer_block(i, size) for i in range(2)]
        for _ in range(400):  # bounded (4 s): both blocks copied here (the copy and its check are one call)
            if [bytes(o) for o in outs[:2]] == want:
                break
            await asyncio.sleep(0.01)
        os.kill(peer.proc.pid, signal.SIGKILL)
        with pytest.raises(PullFailed) as err:
            await pull
        assert err.value.reason == "unavailable"
        assert time.monotonic() - start < 5.0
        assert err.value.blocks == 2  # exactly the blocks that arrived whole and verified before the kill
        assert [bytes(o) for o in outs[:2]] == want
    finally:
        client.close()
        await channel.close()


async def test_stalled_peer_is_a_timeout_at_the_deadline(peers: list[PeerProcess]) -> None:
    size, n = 1 << 20, 4
    peer = PeerProcess("--block-bytes", str(size), "--blocks", str(n), "--stall-after", "1")
    peers.append(peer)
    channel = grpc.aio.insecure_channel(f"127.0.0.1:{peer.info['port']}")
    client = KvSyncClient(channel)
    try:
        outs = [memoryview(bytearray(size)) for _ in range(n)]
        start = time.monotonic()
        with pytest.raises(PullFailed) as err:
            await client.pull(REGION, peer_digests(n), outs, LAYOUT, timeout_s=1.0, prefer_shm=False)
        elapsed = time.monotonic() - start
        assert err.value.reason == "timeout"
        assert 0.9 < elapsed < 3.0
    finally:
        client.close()
        await channel.close()


CONCURRENT_READER = textwrap.dedent(
    """
    import sys, hashlib
    from kvmesh.kvplane.kvsync.tier import CorruptBlock, RegionReader, StaleBlock
    name, keys, rounds = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
    reader = RegionReader.attach(name)
    digests = [hashlib.sha256(f"key-{i}".encode()).digest() for i in range(keys)]
    out = memoryview(bytearray(reader.block_bytes))
    ok = stale = corrupt = wrong = 0
    print("attached", flush=True)
    for _ in range(rounds):
        for d, ref in zip(digests, reader.locate(digests)):
            if ref is None:
                continue
            try:
                k = reader.read_into(ref, d, out)
            except StaleBlock:
                stale += 1
                continue
            except CorruptBlock:
                corrupt += 1
                continue
            if bytes(out[:k]) != d * (k // 32):
                wrong += 1
            else:
                ok += 1
    print(ok, stale, corrupt, wrong, flush=True)
    reader.close()
    """
)


def test_reader_process_never_gets_a_torn_block_while_the_owner_rewrites() -> None:
    """The owner keeps reusing slots (8 slots, 64 identities) while another process reads: every copy it
    returns is the block it asked for (the data of block d is d repeated), or StaleBlock; never a torn or
    mixed copy, which the seqlock would let through only as a CRC failure."""
    size, slots, keys = 64 * 1024, 8, 64
    region = TierRegion.create(f"kvmesh-itc-{os.getpid()}", size, slots, LAYOUT)
    digests = [hashlib.sha256(f"key-{i}".encode()).digest() for i in range(keys)]
    try:
        for d in digests[:slots]:
            region.put(d, d * (size // 32), now_ns=0)
        proc = subprocess.Popen(
            [sys.executable, "-c", CONCURRENT_READER, region.shm_name, str(keys), "300"],
            stdout=subprocess.PIPE,
            text=True,
        )
        assert proc.stdout is not None
        try:
            assert proc.stdout.readline().strip() == "attached"
            writes = 0
            while proc.poll() is None and writes < 2_000_000:  # bounded; rewrite until the reader is done
                d = digests[writes % keys]
                region.evict(d)
                region.put(d, d * (size // 32), now_ns=writes)
                writes += 1
            ok, _stale, corrupt, wrong = map(int, proc.stdout.readline().split())
            assert proc.wait(timeout=60) == 0
        finally:
            proc.kill()
            proc.wait(timeout=30)
        assert wrong == 0 and corrupt == 0
        assert ok > 0 and writes > 0
    finally:
        region.close()


# Mooncake: a peer process offering its region through its Transfer Engine, pulled one-sided over loopback TCP.
# (The engine is a required dependency where these run: no skip.)


def _mooncake_peer(peers: list[PeerProcess], size: int, n: int) -> PeerProcess:
    peer = PeerProcess("--block-bytes", str(size), "--blocks", str(n), "--transport", "mooncake")
    peers.append(peer)
    assert peer.info["transports"] == ["shm", "mooncake", "grpc"], "the peer's Mooncake TE did not start"
    return peer


async def test_mooncake_pull_from_a_peer_process_lands_checked_and_detects_a_corrupt_byte(
    peers: list[PeerProcess],
) -> None:
    size, n, bad = 16384, 8, 3
    peer = _mooncake_peer(peers, size, n)
    channel = grpc.aio.insecure_channel(f"127.0.0.1:{peer.info['port']}")
    client = KvSyncClient(channel, timeout_s=10)
    engine = mooncake.engine()
    assert engine is not None
    landing = np.zeros(n * size, dtype=np.uint8)  # as a worker's staging region: registered, read straight into
    export = engine.register(memoryview(landing.data))
    try:
        want = [peer_block(i, size) for i in range(n)]
        whole = memoryview(landing.data)
        registered = [whole[i * size : (i + 1) * size] for i in range(n)]
        stats = await client.pull(REGION, peer_digests(n), registered, LAYOUT, prefer_shm=False)
        assert (stats.transport, stats.blocks, stats.bytes) == ("mooncake", n, n * size)
        assert [bytes(o) for o in registered] == want
        # flip one data byte of block `bad` in the peer's region (its CRC32C, written with the block, stays)
        reader = RegionReader.attach(peer.info["shm_name"])
        ref = reader.locate(peer_digests(n))[bad]
        assert ref is not None
        at = slot_data_offset(reader.block_bytes, reader.num_slots, ref.slot) + 100
        reader.segment[at] ^= 0xFF
        reader.close()
        outs = [memoryview(bytearray(size)) for _ in range(n)]  # plain buffers: through a staging arena
        with pytest.raises(PullFailed) as err:
            await client.pull(REGION, peer_digests(n), outs, LAYOUT, prefer_shm=False)
        assert err.value.reason == "corrupt"
        assert err.value.delivered.transport == "mooncake"
        assert err.value.blocks == bad  # the blocks before the corrupt one, verified; none after it
        assert [bytes(o) for o in outs[:bad]] == want[:bad]
    finally:
        engine.unregister(export)
        client.close()
        await channel.close()


async def test_mooncake_pull_from_a_peer_killed_mid_read_fails_closed(peers: list[PeerProcess]) -> None:
    size, n = 1 << 20, 192
    peer = _mooncake_peer(peers, size, n)
    channel = grpc.aio.insecure_channel(f"127.0.0.1:{peer.info['port']}")
    client = KvSyncClient(channel, timeout_s=10)
    engine = mooncake.engine()
    assert engine is not None
    try:
        outs = [memoryview(bytearray(size)) for _ in range(n)]
        start = time.monotonic()
        pull = asyncio.create_task(client.pull(REGION, peer_digests(n), outs, LAYOUT, prefer_shm=False))
        for _ in range(10_000):  # bounded (10 s): until the batch read of 192 MiB is under way
            if engine.in_flight or pull.done():
                break
            await asyncio.sleep(0.001)
        assert engine.in_flight, "the Mooncake read never started"
        os.kill(peer.proc.pid, signal.SIGKILL)
        with pytest.raises(PullFailed) as err:
            await pull
        # the read failed (TE error), gRPC under the same lease found the peer gone: nothing delivered
        assert err.value.reason == "unavailable"
        assert err.value.blocks == 0
        assert time.monotonic() - start < 10.0
        # the TE read was what failed first: the region's next pulls skip Mooncake for a while
        assert client.transports(await client.describe(REGION), prefer_shm=False) == ["grpc"]
    finally:
        client.close()
        await channel.close()


async def test_mooncake_pull_from_a_stalled_peer_is_a_timeout_at_the_deadline(peers: list[PeerProcess]) -> None:
    """A peer that stops answering (SIGSTOP: its sockets stay open) holds TE's read until TE's own progress
    timeout; the pull still ends at its deadline (the read lands in a staging arena, left to TE)."""
    size, n = 16384, 8
    peer = _mooncake_peer(peers, size, n)
    channel = grpc.aio.insecure_channel(f"127.0.0.1:{peer.info['port']}")
    client = KvSyncClient(channel, timeout_s=10)
    try:
        lease = await client.acquire_lease(REGION, peer_digests(n), ttl_ms=30_000)
        os.kill(peer.proc.pid, signal.SIGSTOP)
        outs = [memoryview(bytearray(size)) for _ in range(n)]
        start = time.monotonic()
        with pytest.raises(PullFailed) as err:
            await client.pull(REGION, peer_digests(n), outs, LAYOUT, prefer_shm=False, lease=lease, timeout_s=1.0)
        assert (err.value.reason, err.value.blocks) == ("timeout", 0)
        assert 0.9 < time.monotonic() - start < 2.5
    finally:
        client.close()
        await channel.close()


async def test_mooncake_pull_with_an_expired_lease_fails_closed(peers: list[PeerProcess]) -> None:
    size, n = 16384, 4
    peer = _mooncake_peer(peers, size, n)
    channel = grpc.aio.insecure_channel(f"127.0.0.1:{peer.info['port']}")
    client = KvSyncClient(channel, timeout_s=10)
    try:
        lease = await client.acquire_lease(REGION, peer_digests(n), ttl_ms=100)
        lease = dataclasses.replace(lease, deadline=time.monotonic() - 0.001)  # the lease's end has passed here
        outs = [memoryview(bytearray(size)) for _ in range(n)]
        with pytest.raises(PullFailed) as err:
            await client.pull(REGION, peer_digests(n), outs, LAYOUT, prefer_shm=False, lease=lease)
        assert (err.value.reason, err.value.blocks, err.value.delivered.transport) == ("expired", 0, "mooncake")
    finally:
        client.close()
        await channel.close()


async def test_mooncake_offered_but_unreachable_falls_back_to_grpc(peers: list[PeerProcess]) -> None:
    size, n = 16384, 8
    peer = _mooncake_peer(peers, size, n)
    channel = grpc.aio.insecure_channel(f"127.0.0.1:{peer.info['port']}")
    client = KvSyncClient(channel, timeout_s=10)
    try:
        info = await client.describe(REGION)
        assert info.mooncake_session and info.mooncake_base
        # as a peer that advertised a TE session nobody listens at (the cached description is what pulls use)
        client._described[REGION] = dataclasses.replace(info, mooncake_session="127.0.0.1:1")
        want = [peer_block(i, size) for i in range(n)]
        for _ in range(2):  # the first pull tries Mooncake and falls back; the next goes straight to gRPC
            outs = [memoryview(bytearray(size)) for _ in range(n)]
            stats = await client.pull(REGION, peer_digests(n), outs, LAYOUT, prefer_shm=False)
            assert (stats.transport, stats.blocks) == ("grpc", n)
            assert [bytes(o) for o in outs] == want
        assert client.transports(client._described[REGION], prefer_shm=False) == ["grpc"]
    finally:
        client.close()
        await channel.close()
