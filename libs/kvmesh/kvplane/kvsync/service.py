"""The KvSyncService servicer over a worker's tier regions: each a `TierRegion` when this process owns it,
or a `RegionReader` attached to a region another process on the host owns (e.g. the vLLM engine process);
WriteBlocks needs the owner.

This process is the lessor: `AcquireLease` writes the regions' lease arrays, so the owner never reuses a
leased slot, and `ReadBlocks` refuses a block whose lease expired (FAILED_PRECONDITION) or whose slot was
reused (`StaleBlock`). Every input is checked, sizes first, before any work: INVALID_ARGUMENT names the
field, an unknown region is NOT_FOUND. Errors are domain errors; the rpc error interceptor maps them.

Copies of a block's bytes on the way out of `ReadBlocks` (the server side; the client's are in
`kvmesh.kvplane.kvsync.client`):
  1. region -> message bytes: `codec.encode_chunks` joins headers and memoryviews of the region (the only
     copy in Python; the generated serialiser would make two: into a `bytes` field, then into the message);
  2. message bytes -> grpc-core slice (grpc's Python layer copies what the handler yields);
  3. slice -> kernel socket buffer (send).
Register with `add_to_server` (not the generated `add_KvSyncServiceServicer_to_server`): it installs the
identity serialiser that lets `ReadBlocks` yield pre-serialised bytes.

With `mooncake=True` the servicer registers every region's whole segment with the process's Mooncake
Transfer Engine (`kvmesh.kvplane.kvsync.mooncake`) and Describe offers the `mooncake` transport (its session
and the segment's base address): a peer then reads leased blocks one-sided, with no copy here at all. `close`
ends the registrations; call it before the regions are unmapped.
"""

from __future__ import annotations

import logging
import time
from collections.abc import AsyncIterator, Callable, Iterator, Mapping, Sequence
from typing import Any

import grpc

from kvmesh.core.errors import FailedPrecondition, InvalidArgument, NotFound, ResourceExhausted
from kvmesh.kvplane.kvsync import mooncake as te
from kvmesh.kvplane.kvsync.codec import Chunk, encode_chunks
from kvmesh.kvplane.kvsync.tier import DIGEST_BYTES, RegionReader, SlotRef, StaleBlock, TierRegion, checksum
from kvmesh.kvplane.kvsync.transport import offered
from kvmesh.v1 import kvsync_pb2

log = logging.getLogger(__name__)
SERVICE = "kvmesh.v1.KvSyncService"
MAX_BLOCKS = 4096  # per AcquireLease / ReadBlocks / WriteBlocks call
MAX_TTL_MS = 30_000
MESSAGE_DATA_BYTES = 1 << 20  # block data per ReadBlocksResponse, at most
# The first ReadBlocksResponse carries this much, each next one twice the last, up to MESSAGE_DATA_BYTES: the
# client copies the first message while the server encodes the next (a 32 x 16 KiB pull: 2.2 -> 1.6 ms p50 on
# loopback), and a long stream still moves in 1 MiB messages (128 x 1 MiB in 128 KiB ones: 1.21 -> 1.00 GB/s).
FIRST_MESSAGE_DATA_BYTES = 128 << 10
WRITE_CHUNK_BYTES = 1 << 20  # block data per WriteBlocksRequest

# The largest request message each method decodes (for the server's `MessageBounds`).
REQUEST_BOUNDS: dict[str, int] = {
    f"/{SERVICE}/Describe": 1024,
    f"/{SERVICE}/AcquireLease": 1024 + MAX_BLOCKS * (DIGEST_BYTES + 4),
    f"/{SERVICE}/ReadBlocks": 1024 + MAX_BLOCKS * (DIGEST_BYTES + 24),
    f"/{SERVICE}/WriteBlocks": 4096 + WRITE_CHUNK_BYTES,
}


def _digest_ok(field: str, digest: bytes) -> None:
    if len(digest) != DIGEST_BYTES:
        raise InvalidArgument(field, f"must be {DIGEST_BYTES} bytes, got {len(digest)}")


# (region name, digests, each one's slot or None, lease end in ns): a lease this servicer granted a peer
LeaseObserver = Callable[[str, Sequence[bytes], Sequence[SlotRef | None], int], None]


class KvSyncServicer:
    """Serves the regions of one worker, by name. `clock` must be the owner's (CLOCK_MONOTONIC, ns).
    `on_lease` sees every lease granted to a peer (AcquireLease, and ReadBlocks by digest), also one that
    failed part-way: the worker's handoff holds learn from it that a decode worker collected its blocks, and
    which peer leases they must not cut short when they end (`kvmesh.services.worker.handoff`)."""

    def __init__(
        self,
        regions: Mapping[str, TierRegion | RegionReader],
        clock: Callable[[], int] = time.monotonic_ns,
        max_ttl_ms: int = MAX_TTL_MS,
        message_bytes: int = MESSAGE_DATA_BYTES,
        on_lease: LeaseObserver | None = None,
        mooncake: bool = False,
    ) -> None:
        self.regions = regions
        self.clock = clock
        self.max_ttl_ms = max_ttl_ms
        self.message_bytes = message_bytes
        self.on_lease = on_lease
        self._engine = te.engine() if mooncake else None
        self._exports: dict[str, te.Export] = {}
        if self._engine is not None:
            self._export_all(self._engine)

    def _export_all(self, engine: te.MooncakeEngine) -> None:
        for name, region in self.regions.items():
            try:
                self._exports[name] = engine.register(region.segment)
            except te.TransferFailed as e:  # served over shm and gRPC only
                log.warning("kv-sync: region %r not offered over mooncake: %s", name, e)

    def transports(self, region: str) -> list[str]:
        """What Describe offers for reading `region`, best first."""
        return offered("auto", region in self._exports)

    def close(self) -> None:
        """Ends the regions' transfer-engine registrations (before they are unmapped)."""
        if self._engine is not None:
            for export in self._exports.values():
                self._engine.unregister(export)
        self._exports.clear()

    def _region(self, name: str) -> TierRegion | RegionReader:
        if not name:
            raise InvalidArgument("region", "must not be empty")
        region = self.regions.get(name)
        if region is None:
            raise NotFound(f"no kv-sync region {name!r} on this worker")
        return region

    async def Describe(
        self, request: kvsync_pb2.DescribeRequest, context: grpc.aio.ServicerContext
    ) -> kvsync_pb2.DescribeResponse:
        region = self._region(request.region)
        export = self._exports.get(request.region)
        return kvsync_pb2.DescribeResponse(
            region=request.region,
            shm_name=region.shm_name,
            region_id=region.region_id,
            block_bytes=region.block_bytes,
            num_slots=region.num_slots,
            layout=region.layout,
            transports=self.transports(request.region),
            mooncake_session=export.session if export is not None else "",
            mooncake_base=export.base if export is not None else 0,
        )

    def _lease(
        self, region_name: str, digests: Sequence[bytes], ttl_ms: int
    ) -> tuple[TierRegion | RegionReader, list[SlotRef | None], int, int]:
        """(region, refs, lease end, granted ttl) of a lease over `digests`, every input checked first."""
        if not 0 < len(digests) <= MAX_BLOCKS:
            raise InvalidArgument("digests", f"must hold 1..{MAX_BLOCKS} digests, got {len(digests)}")
        if any(len(digest) != DIGEST_BYTES for digest in digests):  # the loop only to name the first bad one
            for i, digest in enumerate(digests):
                _digest_ok(f"digests[{i}]", digest)
        if ttl_ms == 0:
            raise InvalidArgument("ttl_ms", "must be > 0")
        region = self._region(region_name)
        ttl_ms = min(ttl_ms, self.max_ttl_ms)
        until_ns = self.clock() + ttl_ms * 1_000_000
        refs = region.locate(list(digests))
        try:
            region.lease([r for r in refs if r is not None], until_ns)
        finally:  # a StaleBlock leaves the other slots leased: the observer must know of them too
            if self.on_lease is not None:
                self.on_lease(region_name, digests, refs, until_ns)
        return region, refs, until_ns, ttl_ms

    async def AcquireLease(
        self, request: kvsync_pb2.AcquireLeaseRequest, context: grpc.aio.ServicerContext
    ) -> kvsync_pb2.AcquireLeaseResponse:
        region, refs, until_ns, ttl_ms = self._lease(request.region, request.digests, request.ttl_ms)
        response = kvsync_pb2.AcquireLeaseResponse(lease_until_ns=until_ns, ttl_ms=ttl_ms, region_id=region.region_id)
        add = response.blocks.add  # in place: a list of messages passed to the constructor is copied again
        for r in refs:
            if r is not None:
                add(found=True, slot=r.slot, generation=r.generation)
            else:
                add()
        return response

    def _checked_views(
        self, region: TierRegion | RegionReader, blocks: Sequence[kvsync_pb2.BlockRef]
    ) -> list[tuple[SlotRef, memoryview, int]]:
        """Every requested block's (ref, view, crc), or the error: sizes, leases, generations."""
        if not 0 < len(blocks) <= MAX_BLOCKS:
            raise InvalidArgument("blocks", f"must hold 1..{MAX_BLOCKS} blocks, got {len(blocks)}")
        for i, b in enumerate(blocks):
            _digest_ok(f"blocks[{i}].digest", b.digest)
            if b.slot >= region.num_slots:
                raise InvalidArgument(f"blocks[{i}].slot", f"must be < {region.num_slots}, got {b.slot}")
        now = self.clock()
        out = []
        for i, b in enumerate(blocks):
            if region.lease_until(b.slot) <= now:
                raise FailedPrecondition(f"blocks[{i}]: lease expired (or never taken) on slot {b.slot}")
            ref = SlotRef(b.slot, b.generation)
            view, crc = region.view(ref, b.digest)
            out.append((ref, view, crc))
        return out

    async def ReadBlocks(
        self, request: kvsync_pb2.ReadBlocksRequest, context: grpc.aio.ServicerContext
    ) -> AsyncIterator[bytes]:
        """Yields serialised ReadBlocksResponse messages of `message_sizes(message_bytes)` bytes of data."""
        if request.digests:
            if request.blocks:
                raise InvalidArgument("digests", "give leased blocks or digests, not both")
            region, leased, _, _ = self._lease(request.region, request.digests, request.ttl_ms)
            held = []
            for digest, got in zip(request.digests, leased, strict=True):
                if got is None:
                    break
                held.append(kvsync_pb2.BlockRef(digest=digest, slot=got.slot, generation=got.generation))
            if not held:
                return
            views = self._checked_views(region, held)
        else:
            region = self._region(request.region)
            views = self._checked_views(region, request.blocks)
        sizes = message_sizes(self.message_bytes)
        pending: list[Chunk] = []
        refs: list[SlotRef] = []
        room = next(sizes)
        for index, (ref, view, crc) in enumerate(views):
            refs.append(ref)
            offset = 0
            while offset < len(view):  # bounded: each piece takes room > 0 bytes
                piece = view[offset : offset + room]
                last = offset + len(piece) == len(view)
                pending.append(Chunk(index, offset, piece, last, crc if last else 0))
                offset += len(piece)
                room -= len(piece)
                if room == 0:
                    yield _flush(region, pending, refs)
                    pending, refs, room = [], [ref], next(sizes)
        if pending:
            yield _flush(region, pending, refs)

    async def WriteBlocks(
        self, request_iterator: AsyncIterator[kvsync_pb2.WriteBlocksRequest], context: grpc.aio.ServicerContext
    ) -> kvsync_pb2.WriteBlocksResponse:
        region: TierRegion | None = None
        staged: list[tuple[bytes, bytes, int]] = []
        current = bytearray()
        async for chunk in request_iterator:
            if region is None:
                served = self._region(chunk.region)
                if not isinstance(served, TierRegion):
                    raise FailedPrecondition(f"region {chunk.region!r} is owned by another process: read-only here")
                region = served
            if len(staged) >= MAX_BLOCKS:
                raise InvalidArgument("digest", f"at most {MAX_BLOCKS} blocks per call")
            if chunk.offset != len(current):
                raise InvalidArgument("offset", f"expected {len(current)}, got {chunk.offset}")
            current += chunk.data
            if len(current) > region.block_bytes:
                raise InvalidArgument("data", f"block larger than {region.block_bytes} bytes")
            if chunk.last:
                _digest_ok("digest", chunk.digest)
                staged.append((chunk.digest, bytes(current), chunk.crc32c))
                current = bytearray()
        if region is None:
            raise InvalidArgument("region", "empty write stream")
        if current:
            raise InvalidArgument("last", "stream ended in the middle of a block")
        for digest, data, crc in staged:  # verify everything before anything becomes visible
            if checksum(data) != crc:
                raise FailedPrecondition(f"integrity check failed for block {digest.hex()[:16]}: CRC32C mismatch")
        _store_all(region, staged, self.clock())
        return kvsync_pb2.WriteBlocksResponse(
            blocks_written=len(staged), bytes_written=sum(len(d) for _, d, _ in staged)
        )


def message_sizes(most: int) -> Iterator[int]:
    """Data bytes of each ReadBlocksResponse of a stream: `FIRST_MESSAGE_DATA_BYTES`, then twice the last,
    up to `most` (and `most` throughout when it is smaller)."""
    size = min(FIRST_MESSAGE_DATA_BYTES, most)
    while True:
        yield size
        size = min(2 * size, most)


def _flush(region: TierRegion | RegionReader, chunks: list[Chunk], refs: list[SlotRef]) -> bytes:
    """One serialised message, once the slots it copied from are known not to have changed meanwhile."""
    raw = encode_chunks(chunks)
    for ref in refs:  # the seqlock's closing check, after the copy
        if not region.unchanged(ref):
            raise StaleBlock(f"slot {ref.slot} was reused during the read")
    return raw


def _store_all(region: TierRegion, staged: list[tuple[bytes, bytes, int]], now_ns: int) -> None:
    """Stores every block or none (ResourceExhausted when leased slots leave no room)."""
    added: list[bytes] = []
    for digest, data, _crc in staged:
        new = region.contains_prefix([digest]) == 0
        if not region.put(digest, data, now_ns):
            for d in added:
                region.evict(d)
            raise ResourceExhausted(f"region full: every slot of {region.num_slots} is leased", retry_after_s=1.0)
        if new:
            added.append(digest)


def _identity(raw: bytes) -> bytes:
    return raw


def add_to_server(servicer: KvSyncServicer, server: Any) -> None:
    """Registers the servicer on a `grpc.aio.Server` or an `InstrumentedServer`."""
    handlers = {
        "Describe": grpc.unary_unary_rpc_method_handler(
            servicer.Describe,
            request_deserializer=kvsync_pb2.DescribeRequest.FromString,
            response_serializer=kvsync_pb2.DescribeResponse.SerializeToString,
        ),
        "AcquireLease": grpc.unary_unary_rpc_method_handler(
            servicer.AcquireLease,
            request_deserializer=kvsync_pb2.AcquireLeaseRequest.FromString,
            response_serializer=kvsync_pb2.AcquireLeaseResponse.SerializeToString,
        ),
        "ReadBlocks": grpc.unary_stream_rpc_method_handler(
            servicer.ReadBlocks,
            request_deserializer=kvsync_pb2.ReadBlocksRequest.FromString,
            response_serializer=_identity,
        ),
        "WriteBlocks": grpc.stream_unary_rpc_method_handler(
            servicer.WriteBlocks,
            request_deserializer=kvsync_pb2.WriteBlocksRequest.FromString,
            response_serializer=kvsync_pb2.WriteBlocksResponse.SerializeToString,
        ),
    }
    server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(SERVICE, handlers),))
