"""KvSyncService over real gRPC on loopback: round trip, integrity, leases, input checks, capacity, pulls."""

from __future__ import annotations

import dataclasses
import hashlib
import os
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass

import grpc
import pytest

from kvmesh.kvplane.kvsync.client import KvSyncClient, PullFailed
from kvmesh.kvplane.kvsync.peer import BreakingKvSync
from kvmesh.kvplane.kvsync.service import FIRST_MESSAGE_DATA_BYTES, REQUEST_BOUNDS, KvSyncServicer, add_to_server
from kvmesh.kvplane.kvsync.tier import RegionReader, TierRegion, checksum
from kvmesh.rpc.errors import bad_request_fields
from kvmesh.rpc.interceptors import InstrumentedServer, MessageBounds
from kvmesh.v1 import kvsync_pb2

pytestmark = pytest.mark.integration

BLOCK = 96 * 1024
LAYOUT = "test-model|bfloat16|bs32|flat"


@dataclass
class Peer:
    client: KvSyncClient
    region: TierRegion
    clock_ns: list[int]


@pytest.fixture
async def peer() -> AsyncIterator[Peer]:
    region = TierRegion.create(f"kvmesh-it-{os.getpid()}-{os.urandom(4).hex()}", BLOCK, 16, LAYOUT)
    clock_ns = [time.monotonic_ns()]
    servicer = KvSyncServicer({"cpu": region}, clock=lambda: clock_ns[0], message_bytes=32 * 1024)
    server = grpc.aio.server()
    add_to_server(servicer, InstrumentedServer(server, "kvsync", MessageBounds(per_method=REQUEST_BOUNDS)))
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    channel = grpc.aio.insecure_channel(f"127.0.0.1:{port}")
    client = KvSyncClient(channel, timeout_s=10)
    yield Peer(client, region, clock_ns)
    client.close()
    await channel.close()
    await server.stop(None)
    region.close()


def _blocks(n: int, size: int = BLOCK) -> list[tuple[bytes, bytes]]:
    return [(hashlib.sha256(f"block-{i}".encode()).digest(), os.urandom(size)) for i in range(n)]


def _outs(n: int, size: int = BLOCK) -> list[memoryview]:
    return [memoryview(bytearray(size)) for _ in range(n)]


async def test_write_then_read_round_trip(peer: Peer) -> None:
    blocks = _blocks(5)
    done = await peer.client.write_blocks("cpu", blocks, timeout_s=10)
    assert (done.blocks_written, done.bytes_written) == (5, 5 * BLOCK)
    lease = await peer.client.acquire_lease("cpu", [d for d, _ in blocks], ttl_ms=5000)
    assert lease.prefix == 5
    outs = _outs(5)
    stats = await peer.client.read_blocks(lease, outs, 5)
    assert (stats.blocks, stats.bytes) == (5, 5 * BLOCK)
    assert [bytes(o) for o in outs] == [data for _, data in blocks]
    # The data lives in the region's shared memory, where a same-host peer can map it.
    assert bytes(peer.region.get(blocks[0][0], now_ns=0) or b"") == blocks[0][1]


async def test_describe_tells_how_to_attach(peer: Peer) -> None:
    info = await peer.client.describe("cpu")
    assert (info.shm_name, info.block_bytes, info.num_slots, info.layout) == (
        peer.region.shm_name,
        BLOCK,
        16,
        LAYOUT,
    )
    assert info.region_id == peer.region.region_id and len(info.region_id) == 16


async def test_corrupted_write_is_rejected_and_nothing_is_visible(peer: Peer) -> None:
    digest, data = _blocks(1)[0]

    async def corrupted() -> AsyncIterator[kvsync_pb2.WriteBlocksRequest]:
        yield kvsync_pb2.WriteBlocksRequest(
            region="cpu", digest=digest, offset=0, data=data, crc32c=checksum(data) ^ 1, last=True
        )

    with pytest.raises(grpc.aio.AioRpcError) as err:
        await peer.client.stub.WriteBlocks(corrupted(), timeout=10)
    assert err.value.code() == grpc.StatusCode.FAILED_PRECONDITION
    assert "integrity" in (err.value.details() or "")
    lease = await peer.client.acquire_lease("cpu", [digest])  # nothing became visible
    assert lease.refs == [None] and lease.prefix == 0


async def test_unknown_region_and_full_region(peer: Peer) -> None:
    with pytest.raises(grpc.aio.AioRpcError) as err:
        await peer.client.acquire_lease("not-a-region", [b"\0" * 32])
    assert err.value.code() == grpc.StatusCode.NOT_FOUND
    blocks = _blocks(17)
    await peer.client.write_blocks("cpu", blocks[:16])
    await peer.client.acquire_lease("cpu", [d for d, _ in blocks[:16]], ttl_ms=10_000)  # every slot leased
    with pytest.raises(grpc.aio.AioRpcError) as err2:
        await peer.client.write_blocks("cpu", blocks[16:])
    assert err2.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED


async def test_inputs_are_checked_and_name_the_field(peer: Peer) -> None:
    cases = [
        (kvsync_pb2.AcquireLeaseRequest(region="cpu", digests=[], ttl_ms=10), "digests"),
        (kvsync_pb2.AcquireLeaseRequest(region="cpu", digests=[b"\0" * 32, b"short"], ttl_ms=10), "digests[1]"),
        (kvsync_pb2.AcquireLeaseRequest(region="cpu", digests=[b"\0" * 32], ttl_ms=0), "ttl_ms"),
        (kvsync_pb2.AcquireLeaseRequest(region="", digests=[b"\0" * 32], ttl_ms=10), "region"),
    ]
    for request, field in cases:
        with pytest.raises(grpc.aio.AioRpcError) as err:
            await peer.client.stub.AcquireLease(request, timeout=10)
        assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert bad_request_fields(err.value) == [field]
    bad_slot = kvsync_pb2.ReadBlocksRequest(region="cpu", blocks=[kvsync_pb2.BlockRef(digest=b"\0" * 32, slot=99)])
    with pytest.raises(grpc.aio.AioRpcError) as err:
        async for _ in peer.client.stub.ReadBlocks(bad_slot, timeout=10):
            pass
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert bad_request_fields(err.value) == ["blocks[0].slot"]
    too_many = kvsync_pb2.AcquireLeaseRequest(region="cpu", digests=[b"\0" * 32] * 5000, ttl_ms=10)
    with pytest.raises(grpc.aio.AioRpcError) as err:
        await peer.client.stub.AcquireLease(too_many, timeout=10)
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT  # refused on its size, before decoding


async def test_expired_lease_is_failed_precondition_and_a_typed_pull_error(peer: Peer) -> None:
    blocks = _blocks(2)
    await peer.client.write_blocks("cpu", blocks)
    lease = await peer.client.acquire_lease("cpu", [d for d, _ in blocks], ttl_ms=100)
    peer.clock_ns[0] += 200_000_000  # the lessor's clock passes the lease's end
    with pytest.raises(grpc.aio.AioRpcError) as err:
        await peer.client.read_blocks(lease, _outs(2), 2)
    assert err.value.code() == grpc.StatusCode.FAILED_PRECONDITION
    assert "lease expired" in (err.value.details() or "")
    unleased = kvsync_pb2.ReadBlocksRequest(
        region="cpu", blocks=[kvsync_pb2.BlockRef(digest=blocks[0][0], slot=0, generation=2)]
    )
    with pytest.raises(grpc.aio.AioRpcError) as err2:  # a read without a live lease is refused too
        async for _ in peer.client.stub.ReadBlocks(unleased, timeout=10):
            pass
    assert err2.value.code() == grpc.StatusCode.FAILED_PRECONDITION


async def test_reused_slot_is_stale(peer: Peer) -> None:
    blocks = _blocks(1)
    await peer.client.write_blocks("cpu", blocks)
    lease = await peer.client.acquire_lease("cpu", [blocks[0][0]], ttl_ms=100)
    peer.clock_ns[0] += 200_000_000
    assert peer.region.evict(blocks[0][0], now_ns=peer.clock_ns[0])  # lease over: the owner may reuse
    peer.region.put(_blocks(2)[1][0], os.urandom(BLOCK), now_ns=peer.clock_ns[0])
    peer.clock_ns[0] -= 200_000_000  # even within the lease, a changed generation is refused
    with pytest.raises(grpc.aio.AioRpcError) as err:
        await peer.client.read_blocks(lease, _outs(1), 1)
    assert err.value.code() == grpc.StatusCode.FAILED_PRECONDITION


async def test_pull_over_grpc_and_over_shm(peer: Peer) -> None:
    blocks = _blocks(6)
    for d, data in blocks[:4]:
        peer.region.put(d, data, now_ns=0)
    digests = [d for d, _ in blocks]
    outs = _outs(6)
    stats = await peer.client.pull("cpu", digests, outs, LAYOUT, prefer_shm=False)
    assert (stats.transport, stats.blocks, stats.bytes) == ("grpc", 4, 4 * BLOCK)
    assert [bytes(o) for o in outs[:4]] == [data for _, data in blocks[:4]]
    outs = _outs(6)
    stats = await peer.client.pull("cpu", digests, outs, LAYOUT)
    assert (stats.transport, stats.blocks) == ("shm", 4)
    assert [bytes(o) for o in outs[:4]] == [data for _, data in blocks[:4]]


async def test_pull_refuses_a_layout_mismatch(peer: Peer) -> None:
    with pytest.raises(PullFailed) as err:
        await peer.client.pull("cpu", [b"\0" * 32], _outs(1), "other-model|float16|bs16|flat")
    assert err.value.reason == "layout"


@pytest.mark.parametrize("prefer_shm", [False, True])
@pytest.mark.parametrize("at", [1000, 40_000, BLOCK - 1])  # over gRPC: in the first, middle and last chunk
async def test_pull_detects_a_corrupt_byte(peer: Peer, prefer_shm: bool, at: int) -> None:
    blocks = _blocks(2)
    for digest, data in blocks:
        peer.region.put(digest, data, now_ns=0)
    view = peer.region.get(blocks[1][0], now_ns=0)
    assert view is not None
    view[at] ^= 0x01  # a bit flips in the owner's memory after the CRC was written
    del view
    outs = _outs(2)
    with pytest.raises(PullFailed) as err:
        await peer.client.pull("cpu", [d for d, _ in blocks], outs, LAYOUT, prefer_shm=prefer_shm)
    assert err.value.reason == "corrupt"
    assert bytes(outs[0]) == blocks[0][1]  # the block before it arrived whole and checked
    assert err.value.blocks == 1 and err.value.delivered.lengths == [BLOCK]


@pytest.mark.parametrize("prefer_shm", [False, True])
@pytest.mark.parametrize("k", [0, 2, 4])
async def test_a_corrupt_block_at_k_delivers_exactly_the_k_before_it(peer: Peer, prefer_shm: bool, k: int) -> None:
    blocks = _blocks(5)
    for digest, data in blocks:
        peer.region.put(digest, data, now_ns=0)
    view = peer.region.get(blocks[k][0], now_ns=0)
    assert view is not None
    view[BLOCK // 2] ^= 0x80
    del view
    outs = _outs(5)
    with pytest.raises(PullFailed) as err:
        await peer.client.pull("cpu", [d for d, _ in blocks], outs, LAYOUT, prefer_shm=prefer_shm)
    got = err.value.delivered
    assert (err.value.reason, got.blocks, got.bytes) == ("corrupt", k, k * BLOCK)
    assert got.transport == ("shm" if prefer_shm else "grpc")
    assert [bytes(o) for o in outs[:k]] == [data for _, data in blocks[:k]]
    assert got.crcs == [checksum(data) for _, data in blocks[:k]]  # the copies' own CRCs, as written


@pytest.mark.parametrize("messages", [0, 3, 7, 8])  # 3 messages a block: 0, 1, 2 (plus a chunk) and 2 (plus two)
async def test_a_stream_that_dies_after_n_blocks_delivers_exactly_those_n(messages: int) -> None:
    region = TierRegion.create(f"kvmesh-it-dy-{os.getpid()}-{os.urandom(4).hex()}", BLOCK, 8, LAYOUT)
    servicer = BreakingKvSync({"cpu": region}, message_bytes=BLOCK // 3, messages=messages)
    server = grpc.aio.server()
    add_to_server(servicer, server)
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    channel = grpc.aio.insecure_channel(f"127.0.0.1:{port}")
    client = KvSyncClient(channel, timeout_s=10)
    try:
        blocks = _blocks(6)
        for digest, data in blocks:
            region.put(digest, data, now_ns=0)
        outs = _outs(6)
        with pytest.raises(PullFailed) as err:
            await client.pull("cpu", [d for d, _ in blocks], outs, LAYOUT, prefer_shm=False)
        n = messages // 3
        assert (err.value.reason, err.value.blocks, err.value.delivered.lengths) == ("unavailable", n, [BLOCK] * n)
        assert [bytes(o) for o in outs[:n]] == [data for _, data in blocks[:n]]
    finally:
        client.close()
        await channel.close()
        await server.stop(None)
        region.close()


async def test_pull_maps_an_unknown_region(peer: Peer) -> None:
    with pytest.raises(PullFailed) as err:
        await peer.client.pull("gpu9", [b"\0" * 32], _outs(1), LAYOUT)
    assert err.value.reason == "not_found"


async def test_grpc_pull_leases_by_digest_in_one_read(peer: Peer) -> None:
    blocks = _blocks(3)
    for d, data in blocks[:2]:
        peer.region.put(d, data, now_ns=0)
    stats = await peer.client.read_digests("cpu", [d for d, _ in blocks], _outs(3), ttl_ms=4000)
    assert (stats.blocks, stats.bytes) == (2, 2 * BLOCK)  # the leading held blocks, up to the first missing
    for d, _ in blocks[:2]:
        (ref,) = peer.region.locate([d])
        assert ref is not None and peer.region.lease_until(ref.slot) >= peer.clock_ns[0] + 4_000_000_000
    both = kvsync_pb2.ReadBlocksRequest(
        region="cpu", blocks=[kvsync_pb2.BlockRef(digest=blocks[0][0])], digests=[blocks[0][0]], ttl_ms=10
    )
    with pytest.raises(grpc.aio.AioRpcError) as err:
        async for _ in peer.client.stub.ReadBlocks(both, timeout=10):
            pass
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert bad_request_fields(err.value) == ["digests"]


async def test_pull_with_a_given_lease_makes_no_lease_call(peer: Peer) -> None:
    blocks = _blocks(2)
    for d, data in blocks:
        peer.region.put(d, data, now_ns=0)
    lease = await peer.client.acquire_lease("cpu", [d for d, _ in blocks], ttl_ms=5000)

    def no_lease_call(*args: object, **kwargs: object) -> None:
        raise AssertionError("pull called AcquireLease although it was given a lease")

    peer.client.stub.AcquireLease = no_lease_call  # type: ignore[method-assign]
    for prefer_shm in (True, False):
        outs = _outs(2)
        stats = await peer.client.pull("cpu", [d for d, _ in blocks], outs, LAYOUT, prefer_shm=prefer_shm, lease=lease)
        assert stats.blocks == 2 and [bytes(o) for o in outs] == [data for _, data in blocks]


async def test_shm_pull_follows_a_replaced_region_of_the_same_name() -> None:
    """A worker restarted: same region name, a new segment. The client's cached mapping is of the old one;
    the lease's region id tells it to describe and attach again, not to read the old segment."""
    first = TierRegion.create(f"kvmesh-it-old-{os.getpid()}", BLOCK, 4, LAYOUT)
    second = TierRegion.create(f"kvmesh-it-new-{os.getpid()}", BLOCK, 4, LAYOUT)
    regions = {"cpu": first}
    server = grpc.aio.server()
    add_to_server(KvSyncServicer(regions), server)
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    channel = grpc.aio.insecure_channel(f"127.0.0.1:{port}")
    client = KvSyncClient(channel, timeout_s=10)
    try:
        old, new = _blocks(1)[0], (hashlib.sha256(b"other").digest(), os.urandom(BLOCK))
        first.put(*old, now_ns=0)
        second.put(hashlib.sha256(b"filler").digest(), os.urandom(BLOCK), now_ns=0)  # `new` lands in slot 1
        second.put(*new, now_ns=0)
        assert (await client.pull("cpu", [old[0]], _outs(1), LAYOUT)).transport == "shm"
        regions["cpu"] = second
        outs = _outs(1)
        stats = await client.pull("cpu", [new[0]], outs, LAYOUT)
        assert (stats.transport, stats.blocks) == ("shm", 1)
        assert bytes(outs[0]) == new[1]
        assert (await client.describe("cpu")).shm_name == second.shm_name
    finally:
        client.close()
        await channel.close()
        await server.stop(None)
        first.close()
        second.close()


@pytest.mark.parametrize("prefer_shm", [False, True])
async def test_pull_with_an_expired_lease_is_pull_failed_expired(peer: Peer, prefer_shm: bool) -> None:
    blocks = _blocks(2)
    for d, data in blocks:
        peer.region.put(d, data, now_ns=0)
    lease = await peer.client.acquire_lease("cpu", [d for d, _ in blocks], ttl_ms=100)
    peer.clock_ns[0] += 200_000_000  # the lessor's clock passes the lease's end (gRPC path)
    if prefer_shm:  # the shm path compares the lease's end with this host's clock
        lease = dataclasses.replace(lease, lease_until_ns=time.monotonic_ns() - 1)
    with pytest.raises(PullFailed) as err:
        await peer.client.pull("cpu", [d for d, _ in blocks], _outs(2), LAYOUT, prefer_shm=prefer_shm, lease=lease)
    assert err.value.reason == "expired"


async def test_serving_a_region_another_process_owns() -> None:
    """The worker serves a region it attached (the owner is e.g. the vLLM engine process): its leases land
    in the owner's lease array, so the owner keeps the leased block; writes are refused."""
    owner = TierRegion.create(f"kvmesh-it-own-{os.getpid()}", BLOCK, 1, LAYOUT)
    attached = RegionReader.attach(owner.shm_name)
    server = grpc.aio.server()
    add_to_server(KvSyncServicer({"cpu": attached}), InstrumentedServer(server, "kvsync"))
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    channel = grpc.aio.insecure_channel(f"127.0.0.1:{port}")
    client = KvSyncClient(channel, timeout_s=10)
    try:
        (d, data), (d2, data2) = _blocks(2)
        owner.put(d, data, now_ns=time.monotonic_ns())
        outs = _outs(1)
        stats = await client.pull("cpu", [d], outs, LAYOUT, prefer_shm=False, ttl_ms=10_000)
        assert stats.blocks == 1 and bytes(outs[0]) == data
        assert not owner.put(d2, data2, now_ns=time.monotonic_ns())  # the one slot is leased: kept
        assert owner.contains_prefix([d]) == 1
        with pytest.raises(grpc.aio.AioRpcError) as err:
            await client.write_blocks("cpu", [(d2, data2)])
        assert err.value.code() == grpc.StatusCode.FAILED_PRECONDITION
    finally:
        client.close()
        await channel.close()
        await server.stop(None)
        attached.close()
        owner.close()


async def test_read_messages_start_small_and_double_up_to_the_message_size() -> None:
    """A ReadBlocks stream's messages carry FIRST_MESSAGE_DATA_BYTES, then twice the last each time, up to
    the servicer's message size (the client copies one while the next is encoded); every block arrives whole."""
    block, n = 64 * 1024, 30  # 1920 KiB: 128 + 256 + 512 + 1024 KiB
    region = TierRegion.create(f"kvmesh-it-{os.getpid()}-{os.urandom(4).hex()}", block, n, LAYOUT)
    server = grpc.aio.server()
    add_to_server(KvSyncServicer({"cpu": region}, message_bytes=1 << 20), server)
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    try:
        async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
            client = KvSyncClient(channel, timeout_s=10)
            blocks = _blocks(n, block)
            await client.write_blocks("cpu", blocks, timeout_s=10)
            read = channel.unary_stream(
                "/kvmesh.v1.KvSyncService/ReadBlocks",
                request_serializer=kvsync_pb2.ReadBlocksRequest.SerializeToString,
                response_deserializer=kvsync_pb2.ReadBlocksResponse.FromString,
            )
            request = kvsync_pb2.ReadBlocksRequest(region="cpu", digests=[d for d, _ in blocks], ttl_ms=5000)
            messages = [m async for m in read(request, timeout=10)]
            sizes = [sum(len(c.data) for c in m.chunks) for m in messages]
            assert sizes == [FIRST_MESSAGE_DATA_BYTES << k for k in range(4)] == [131072, 262144, 524288, 1048576]
            got: dict[int, bytes] = {}
            for c in (c for m in messages for c in m.chunks):
                got[c.index] = got.get(c.index, b"") + c.data
            assert [got[i] for i in range(n)] == [data for _, data in blocks]
            client.close()
    finally:
        await server.stop(None)
        region.close()
