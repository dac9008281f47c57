"""The KvSyncService servicer: one-sided reads and writes of registered regions over gRPC streams.

Reads stream each block in chunks of `chunk_bytes` sliced from the region (memoryview: the only copy is the
one into the HTTP/2 frame); the last chunk of a block carries its CRC32C. A write is complete when the
response arrives: every block was verified and stored, or the call fails and nothing partial is visible.
"""

from __future__ import annotations

from collections.abc import AsyncIterator

import grpc

from kvmesh.errors import InvalidArgument
from kvmesh.kvsync.regions import RegionTable, checksum
from kvmesh.v1 import kvsync_pb2, kvsync_pb2_grpc

CHUNK_BYTES = 1 << 20


class KvSyncServicer(kvsync_pb2_grpc.KvSyncServiceServicer):
    """Serves the regions of one `RegionTable`."""

    def __init__(self, regions: RegionTable, chunk_bytes: int = CHUNK_BYTES) -> None:
        self.regions = regions
        self.chunk_bytes = chunk_bytes

    async def RegisterRegion(  # type: ignore[override]
        self, request: kvsync_pb2.RegisterRegionRequest, context: grpc.aio.ServicerContext
    ) -> kvsync_pb2.RegisterRegionResponse:
        region = self.regions.register(request.name, request.block_bytes, request.num_blocks, request.shm_name)
        return kvsync_pb2.RegisterRegionResponse(region_key=region.key)

    async def DeregisterRegion(  # type: ignore[override]
        self, request: kvsync_pb2.DeregisterRegionRequest, context: grpc.aio.ServicerContext
    ) -> kvsync_pb2.DeregisterRegionResponse:
        self.regions.deregister(request.region_key)
        return kvsync_pb2.DeregisterRegionResponse()

    async def ReadBlocks(  # type: ignore[override]
        self, request: kvsync_pb2.ReadBlocksRequest, context: grpc.aio.ServicerContext
    ) -> AsyncIterator[kvsync_pb2.ReadBlocksResponse]:
        region = self.regions.get(request.region_key)
        views = [(b.digest, region.read(b.digest)) for b in request.blocks]  # all-or-nothing: check first
        for digest, view in views:
            block = kvsync_pb2.BlockId(digest=digest)
            for offset in range(0, len(view), self.chunk_bytes):
                last = offset + self.chunk_bytes >= len(view)
                yield kvsync_pb2.ReadBlocksResponse(
                    block=block,
                    offset=offset,
                    data=bytes(view[offset : offset + self.chunk_bytes]),
                    crc32c=checksum(view) if last else 0,
                    last=last,
                )

    async def WriteBlocks(  # type: ignore[override]
        self, request_iterator: AsyncIterator[kvsync_pb2.WriteBlocksRequest], context: grpc.aio.ServicerContext
    ) -> kvsync_pb2.WriteBlocksResponse:
        region = None
        staged: list[tuple[bytes, bytes, int]] = []
        current = bytearray()
        async for chunk in request_iterator:
            if region is None:
                region = self.regions.get(chunk.region_key)
            if chunk.offset != len(current):
                raise InvalidArgument("offset", f"expected {len(current)}, got {chunk.offset}")
            current += chunk.data
            if len(current) > region.block_bytes:
                raise InvalidArgument("data", f"block larger than {region.block_bytes} bytes")
            if chunk.last:
                staged.append((chunk.block.digest, bytes(current), chunk.crc32c))
                current = bytearray()
        if region is None:
            raise InvalidArgument("region_key", "empty write stream")
        if current:
            raise InvalidArgument("last", "stream ended in the middle of a block")
        for digest, data, crc in staged:  # verify everything before anything becomes visible
            if checksum(data) != crc:
                region.write(digest, data, crc)  # raises the integrity error
        for digest, data, crc in staged:
            region.write(digest, data, crc)
        return kvsync_pb2.WriteBlocksResponse(
            blocks_written=len(staged), bytes_written=sum(len(d) for _, d, _ in staged)
        )
