"""kv-sync across real processes: a reader process attached to a region, a peer process served over gRPC
(pulled over its socket and over its shared memory), the peer killed with SIGKILL mid-stream."""

from __future__ import annotations

import asyncio
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
import pytest

from kvmesh.kvplane.kvsync.client import KvSyncClient, PullFailed
from kvmesh.kvplane.kvsync.peer import LAYOUT, REGION, peer_block, peer_digests
from kvmesh.kvplane.kvsync.tier import TierRegion

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
