"""kv-sync over real gRPC on loopback: round trip, integrity, capability keys, capacity."""

from __future__ import annotations

import hashlib
import os
from collections.abc import AsyncIterator

import grpc
import pytest

from kvmesh.kvsync.client import KvSyncClient
from kvmesh.kvsync.regions import RegionTable, checksum
from kvmesh.kvsync.service import KvSyncServicer
from kvmesh.rpc.interceptors import ServiceInterceptor
from kvmesh.v1 import kvsync_pb2, kvsync_pb2_grpc

pytestmark = pytest.mark.integration

BLOCK = 96 * 1024


@pytest.fixture
async def peer() -> AsyncIterator[tuple[KvSyncClient, RegionTable]]:
    table = RegionTable()
    server = grpc.aio.server(interceptors=[ServiceInterceptor("kvsync")])
    kvsync_pb2_grpc.add_KvSyncServiceServicer_to_server(KvSyncServicer(table, chunk_bytes=32 * 1024), server)
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    channel = grpc.aio.insecure_channel(f"127.0.0.1:{port}")
    yield KvSyncClient(channel), table
    await channel.close()
    await server.stop(None)
    table.close()


def _blocks(n: int) -> list[tuple[bytes, bytes]]:
    return [(hashlib.sha256(f"block-{i}".encode()).digest(), os.urandom(BLOCK)) for i in range(n)]


async def test_write_then_read_round_trip(peer: tuple[KvSyncClient, RegionTable]) -> None:
    client, table = peer
    region = table.register("gpu0", BLOCK, 16, shm_name=f"kvmesh-test-{os.getpid()}")
    blocks = _blocks(5)
    done = await client.write_blocks(region.key, blocks, timeout=10)
    assert (done.blocks_written, done.bytes_written) == (5, 5 * BLOCK)
    got = await client.read_blocks(region.key, [d for d, _ in blocks], timeout=10)
    assert got == dict(blocks)
    # The data lives in the region's shared memory, where a same-host peer can map it.
    assert bytes(region.read(blocks[0][0])) == blocks[0][1]


async def test_corrupted_write_is_rejected_and_nothing_is_visible(peer: tuple[KvSyncClient, RegionTable]) -> None:
    client, table = peer
    region = table.register("gpu0", BLOCK, 4)
    digest, data = _blocks(1)[0]

    async def corrupted() -> AsyncIterator[kvsync_pb2.WriteBlocksRequest]:
        yield kvsync_pb2.WriteBlocksRequest(
            region_key=region.key,
            block=kvsync_pb2.BlockId(digest=digest),
            offset=0,
            data=data,
            crc32c=checksum(data) ^ 1,
            last=True,
        )

    with pytest.raises(grpc.aio.AioRpcError) as err:
        await client.stub.WriteBlocks(corrupted(), timeout=10)
    assert err.value.code() == grpc.StatusCode.FAILED_PRECONDITION
    assert "integrity" in (err.value.details() or "")
    with pytest.raises(grpc.aio.AioRpcError) as err2:
        await client.read_blocks(region.key, [digest], timeout=10)
    assert err2.value.code() == grpc.StatusCode.NOT_FOUND


async def test_unknown_region_and_full_region(peer: tuple[KvSyncClient, RegionTable]) -> None:
    client, table = peer
    with pytest.raises(grpc.aio.AioRpcError) as err:
        await client.read_blocks("not-a-key", [b"\0" * 32], timeout=10)
    assert err.value.code() == grpc.StatusCode.NOT_FOUND
    region = table.register("small", BLOCK, 2)
    with pytest.raises(grpc.aio.AioRpcError) as err2:
        await client.write_blocks(region.key, _blocks(3), timeout=10)
    assert err2.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
