"""Client side of kv-sync: one-sided reads and writes of a peer's registered regions over gRPC."""

from __future__ import annotations

from collections.abc import AsyncIterator, Sequence

import grpc

from kvmesh.errors import FailedPrecondition
from kvmesh.kvsync.regions import checksum
from kvmesh.kvsync.service import CHUNK_BYTES
from kvmesh.v1 import kvsync_pb2, kvsync_pb2_grpc


class KvSyncClient:
    """Reads and writes blocks of a peer's registered regions."""

    def __init__(self, channel: grpc.aio.Channel) -> None:
        self.stub = kvsync_pb2_grpc.KvSyncServiceStub(channel)

    async def read_blocks(
        self, region_key: str, digests: Sequence[bytes], timeout: float | None = None
    ) -> dict[bytes, bytes]:
        """Fetches blocks; each is verified against the CRC32C the peer computed from its memory."""
        request = kvsync_pb2.ReadBlocksRequest(
            region_key=region_key, blocks=[kvsync_pb2.BlockId(digest=d) for d in digests]
        )
        out: dict[bytes, bytes] = {}
        parts: list[bytes] = []
        async for chunk in self.stub.ReadBlocks(request, timeout=timeout):
            parts.append(chunk.data)
            if chunk.last:
                data = b"".join(parts)
                parts = []
                if checksum(data) != chunk.crc32c:
                    raise FailedPrecondition(f"integrity check failed reading {chunk.block.digest.hex()[:16]}…")
                out[chunk.block.digest] = data
        return out

    async def write_blocks(
        self, region_key: str, blocks: Sequence[tuple[bytes, bytes]], timeout: float | None = None
    ) -> kvsync_pb2.WriteBlocksResponse:
        """Writes (digest, data) blocks; returns the completion once all are verified and stored."""

        async def chunks() -> AsyncIterator[kvsync_pb2.WriteBlocksRequest]:
            first = True
            for digest, data in blocks:
                view = memoryview(data)
                for offset in range(0, len(view), CHUNK_BYTES):
                    last = offset + CHUNK_BYTES >= len(view)
                    yield kvsync_pb2.WriteBlocksRequest(
                        region_key=region_key if first else "",
                        block=kvsync_pb2.BlockId(digest=digest),
                        offset=offset,
                        data=bytes(view[offset : offset + CHUNK_BYTES]),
                        crc32c=checksum(view) if last else 0,
                        last=last,
                    )
                    first = False

        return await self.stub.WriteBlocks(chunks(), timeout=timeout)
