"""Client side of kv-sync: a peer's tier over KvSyncService, and `pull`, which picks the best transport.

`pull` asks for one lease per call (`AcquireLease`), then copies the leading held blocks into the caller's
buffers over the first transport of `transport.transport_order`: straight from the peer's shared memory when
its region attaches here (same host: the name opens and the region id matches), else one-sided through
Mooncake's Transfer Engine when both sides run one (`mooncake`), else over `ReadBlocks`. A Mooncake transfer
that fails (cannot connect, a TE error) falls back to `ReadBlocks` under the same lease. Each block is
verified (CRC32C on the copy, generation, identity) whichever transport moved it. Whatever else goes wrong
(dead peer, deadline, corrupt or stale block, expired lease, unknown region, layout mismatch) raises
`PullFailed`, which the caller turns into a recompute; `PullFailed.delivered` says how many leading blocks had
arrived whole and verified before the failure (the caller may keep those, never a block after them). Every
call has a deadline.

Copies of a block's bytes on the gRPC path, client side (server side: `kvmesh.kvplane.kvsync.service`):
  4. kernel -> grpc-core slice (receive);
  5. slice -> the Python `bytes` grpc hands the deserialiser;
  6. `bytes` -> the caller's buffer (`codec.decode_chunks` slices memoryviews out of the message; the
     generated parser would copy each block into a field first), CRC32C computed in the same pass
     (`tier.copy_checksum`, continued across a block's chunks), so verifying reads no byte twice. The
     buffer may be a reserved slot of the caller's own region (`TierRegion.reserve`), which then publishes
     the block with `stats.crcs` (a vLLM worker's staging): no further copy or checksum.
On the shared-memory path there is one: region -> the caller's buffer, checked in the same pass. On the
Mooncake path: TE's read (peer region -> the caller's buffer when it lies in memory registered with this
process's TE, e.g. a staging region, then a CRC32C pass over it; else -> a registered staging arena, then
`copy_checksum` into the caller's buffer: one pass that copies and checks), slot headers in the same batch.
Neither path can time its check apart from its copy: `bench kvsync` measures the check's cost as a checked
minus a plain copy of the same blocks through the same code (`verify=False`).
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import time
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass, field

import grpc

from kvmesh.core.errors import FailedPrecondition, KvmeshError, NotFound, Unavailable
from kvmesh.kvplane.kvsync import mooncake as te
from kvmesh.kvplane.kvsync.codec import Chunk, decode_chunks
from kvmesh.kvplane.kvsync.service import SERVICE, WRITE_CHUNK_BYTES
from kvmesh.kvplane.kvsync.tier import (
    SLOT_HEADER_BYTES,
    CorruptBlock,
    RegionReader,
    SlotRef,
    StaleBlock,
    checksum,
    copy_checksum,
    iter_slot_headers,
    slot_data_offset,
    slot_header_offset,
)
from kvmesh.kvplane.kvsync.transport import GRPC, MOONCAKE, SHM, check_choice, transport_order
from kvmesh.v1 import kvsync_pb2, kvsync_pb2_grpc

DEFAULT_TIMEOUT_S = 2.0
DEFAULT_TTL_MS = 5_000
MOONCAKE_RETRY_S = 10.0  # after a failed Mooncake transfer, a region's pulls go over gRPC this long

log = logging.getLogger(__name__)


@dataclass
class PullStats:
    """What one pull did: transport (shm | mooncake | grpc), leading blocks copied and verified, their bytes, each one's
    length and CRC32C (from the copy's own pass; what a staging region publishes without recomputing)."""

    transport: str
    blocks: int = 0
    bytes: int = 0
    lengths: list[int] = field(default_factory=list)
    crcs: list[int] = field(default_factory=list)

    def add(self, length: int, crc: int) -> None:
        """One more leading block copied and verified."""
        self.lengths.append(length)
        self.crcs.append(crc)
        self.blocks += 1
        self.bytes += length

    def discard(self) -> None:
        """Forgets every block (none of them may be used)."""
        self.blocks = self.bytes = 0
        self.lengths.clear()
        self.crcs.clear()


class PullFailed(Unavailable):
    """A pull did not complete; recompute the blocks it did not deliver. `reason`: unavailable, timeout,
    corrupt, stale, expired, not_found, layout or protocol. `delivered`: the leading blocks that arrived whole
    and verified before the failure (`blocks` of them, in the caller's first `blocks` buffers; 0 when the
    failure came first, or when it casts doubt on all of them). (Unavailable: if it ever escapes to a caller,
    the cached copy is what was unavailable.)"""

    def __init__(self, reason: str, message: str, delivered: PullStats | None = None) -> None:
        super().__init__(f"kv pull failed ({reason}): {message}")
        self.reason = reason
        self.delivered = delivered if delivered is not None else PullStats("none")

    @property
    def blocks(self) -> int:
        """How many leading blocks were delivered verified (usable; every later one is not)."""
        return self.delivered.blocks


@dataclass(frozen=True)
class RegionInfo:
    """A peer's region, as `Describe` tells it."""

    region: str
    shm_name: str
    region_id: bytes
    block_bytes: int
    num_slots: int
    layout: str
    transports: tuple[str, ...] = ()  # offered, best first (empty: an older server, shm and grpc)
    mooncake_session: str = ""  # the peer's TE session, where the region is registered ("" = not offered)
    mooncake_base: int = 0  # the region segment's address in the peer's process


@dataclass(frozen=True)
class Lease:
    """Leased blocks: `refs[i]` is None where the peer does not hold `digests[i]`. `deadline` is the lease's
    end on this process's `time.monotonic()`, counted from before the request was sent."""

    region: str
    digests: list[bytes]
    refs: list[SlotRef | None]
    lease_until_ns: int
    deadline: float
    region_id: bytes = b""

    @property
    def prefix(self) -> int:
        """How many leading blocks are held."""
        for i, ref in enumerate(self.refs):
            if ref is None:
                return i
        return len(self.refs)


def _failed(err: grpc.aio.AioRpcError, delivered: PullStats) -> PullFailed:
    code = err.code()
    reason = {
        grpc.StatusCode.DEADLINE_EXCEEDED: "timeout",
        grpc.StatusCode.NOT_FOUND: "not_found",
        grpc.StatusCode.FAILED_PRECONDITION: "stale",
        grpc.StatusCode.INTERNAL: "protocol",
    }.get(code, "unavailable")
    details = err.details() or ""
    if code == grpc.StatusCode.FAILED_PRECONDITION and "lease expired" in details:
        reason = "expired"
    return PullFailed(reason, f"{code.name}: {details}", delivered)


class KvSyncClient:
    """One peer's KvSyncService. Every call has a deadline (`timeout_s`, default `DEFAULT_TIMEOUT_S`)."""

    def __init__(self, channel: grpc.aio.Channel, timeout_s: float = DEFAULT_TIMEOUT_S) -> None:
        self.stub = kvsync_pb2_grpc.KvSyncServiceStub(channel)
        self.timeout_s = timeout_s
        self._read = channel.unary_stream(
            f"/{SERVICE}/ReadBlocks",
            request_serializer=kvsync_pb2.ReadBlocksRequest.SerializeToString,
            response_deserializer=decode_chunks,
        )
        self._described: dict[str, RegionInfo] = {}
        self._readers: dict[str, RegionReader | None] = {}
        self._mooncake_down: dict[str, float] = {}  # region -> until when its Mooncake transfers are skipped

    async def describe(self, region: str, timeout_s: float | None = None) -> RegionInfo:
        """The peer's region (cached: a region's description does not change while it lives)."""
        info = self._described.get(region)
        if info is None:
            r = await self.stub.Describe(kvsync_pb2.DescribeRequest(region=region), timeout=timeout_s or self.timeout_s)
            info = RegionInfo(
                r.region,
                r.shm_name,
                r.region_id,
                r.block_bytes,
                r.num_slots,
                r.layout,
                tuple(r.transports),
                r.mooncake_session,
                r.mooncake_base,
            )
            self._described[region] = info
        return info

    async def acquire_lease(
        self, region: str, digests: Sequence[bytes], ttl_ms: int = DEFAULT_TTL_MS, timeout_s: float | None = None
    ) -> Lease:
        """One lease over every digest (one RPC)."""
        start = time.monotonic()
        r = await self.stub.AcquireLease(
            kvsync_pb2.AcquireLeaseRequest(region=region, digests=list(digests), ttl_ms=ttl_ms),
            timeout=timeout_s or self.timeout_s,
        )
        refs = [SlotRef(b.slot, b.generation) if b.found else None for b in r.blocks]
        return Lease(region, list(digests), refs, r.lease_until_ns, start + r.ttl_ms / 1000, r.region_id)

    async def read_blocks(
        self,
        lease: Lease,
        outs: Sequence[memoryview],
        count: int,
        timeout_s: float | None = None,
        stats: PullStats | None = None,
    ) -> PullStats:
        """Streams the first `count` leased blocks into `outs`, verifying each (raises CorruptBlock on a CRC
        mismatch, FailedPrecondition on a malformed stream; grpc errors as they come). `stats` (when given)
        counts the verified blocks as they complete, so it holds the delivered prefix if this raises."""
        blocks = [
            kvsync_pb2.BlockRef(digest=d, slot=ref.slot, generation=ref.generation)
            for d, ref in zip(lease.digests[:count], lease.refs[:count], strict=True)
            if ref is not None
        ]
        request = kvsync_pb2.ReadBlocksRequest(region=lease.region, blocks=blocks)
        return await self._stream(request, outs, count, timeout_s, stats)

    async def read_digests(
        self,
        region: str,
        digests: Sequence[bytes],
        outs: Sequence[memoryview],
        ttl_ms: int = DEFAULT_TTL_MS,
        timeout_s: float | None = None,
        stats: PullStats | None = None,
    ) -> PullStats:
        """Leases and streams the leading blocks of `digests` the peer holds, in one call (`stats.blocks`
        says how many; `stats` as in `read_blocks`)."""
        request = kvsync_pb2.ReadBlocksRequest(region=region, digests=list(digests), ttl_ms=ttl_ms)
        return await self._stream(request, outs, None, timeout_s, stats)

    async def _stream(
        self,
        request: kvsync_pb2.ReadBlocksRequest,
        outs: Sequence[memoryview],
        count: int | None,
        timeout_s: float | None,
        stats: PullStats | None,
    ) -> PullStats:
        if stats is None:
            stats = PullStats("grpc")
        stats.transport = "grpc"
        assembly = BlockAssembly(outs, len(outs) if count is None else count, stats)
        call = self._read(request, timeout=timeout_s or self.timeout_s)
        async for chunks in call:
            for chunk in chunks:
                assembly.add(chunk)
        if count is not None:
            assembly.finish()
        elif assembly.filled:
            raise FailedPrecondition(f"stream ended inside block {assembly.index}")
        return stats

    async def write_blocks(
        self, region: str, blocks: Sequence[tuple[bytes, bytes | memoryview]], timeout_s: float | None = None
    ) -> kvsync_pb2.WriteBlocksResponse:
        """Stores (digest, data) blocks in the peer's region; returns once all are verified and stored."""

        async def chunks() -> AsyncIterator[kvsync_pb2.WriteBlocksRequest]:
            first = True
            for digest, data in blocks:
                view = memoryview(data)
                crc = checksum(view)
                for offset in range(0, max(len(view), 1), WRITE_CHUNK_BYTES):
                    last = offset + WRITE_CHUNK_BYTES >= len(view)
                    yield kvsync_pb2.WriteBlocksRequest(
                        region=region if first else "",
                        digest=digest,
                        offset=offset,
                        data=bytes(view[offset : offset + WRITE_CHUNK_BYTES]),
                        crc32c=crc if last else 0,
                        last=last,
                    )
                    first = False

        return await self.stub.WriteBlocks(chunks(), timeout=timeout_s or self.timeout_s)

    def _reader(self, info: RegionInfo) -> RegionReader | None:
        """The peer's region mapped here, when it is on this host (name opens, same region id)."""
        if info.region in self._readers:
            return self._readers[info.region]
        reader = None
        if info.shm_name:
            try:
                reader = RegionReader.attach(info.shm_name)
            except (NotFound, FailedPrecondition):
                reader = None
            if reader is not None and reader.region_id != info.region_id:
                reader.close()
                reader = None
        self._readers[info.region] = reader
        return reader

    async def pull(
        self,
        region: str,
        digests: Sequence[bytes],
        outs: Sequence[memoryview],
        layout: str,
        ttl_ms: int = DEFAULT_TTL_MS,
        timeout_s: float | None = None,
        prefer_shm: bool = True,
        lease: Lease | None = None,
        transport: str = "auto",
    ) -> PullStats:
        """Copies the leading blocks of `digests` the peer holds into `outs` (one buffer per digest) within
        `timeout_s`; `stats.blocks` says how many, `stats.transport` over what. Raises PullFailed (recompute)
        on any failure, its `delivered` the leading blocks verified before it (for `outs` in a staging region:
        the ones to publish).

        `transport`: auto (the best both sides offer: shm, mooncake, grpc) or the one to prefer (then grpc);
        `prefer_shm=False` rules shm out. Calls: one AcquireLease (none when `lease`, e.g. from a router's
        pull hint, is given), then shm or Mooncake reads, or one ReadBlocks (leasing by digest when it is the
        only transport, else reading the lease). Plus one Describe per region and client."""
        if len(outs) < len(digests):
            raise ValueError("one output buffer per digest")
        check_choice("transport", transport)
        budget = timeout_s or self.timeout_s
        progress = PullStats(GRPC)  # the verified leading blocks, as they complete
        try:
            pulling = self._pull(region, digests, outs, layout, ttl_ms, budget, prefer_shm, lease, transport, progress)
            # wait_for returns only once the cancelled pull has stopped: nothing writes `outs` after a raise
            return await asyncio.wait_for(pulling, budget)
        except PullFailed as e:
            e.delivered = progress
            raise
        except TimeoutError:
            raise PullFailed("timeout", f"no complete pull within {budget:.3f} s", progress) from None
        except grpc.aio.AioRpcError as e:
            raise _failed(e, progress) from None
        except CorruptBlock as e:
            raise PullFailed("corrupt", e.message, progress) from None
        except StaleBlock as e:
            raise PullFailed("stale", e.message, progress) from None
        except KvmeshError as e:
            raise PullFailed("protocol", e.message, progress) from None

    def transports(self, info: RegionInfo, transport: str = "auto", prefer_shm: bool = True) -> list[str]:
        """The transports a pull from the peer's region tries, in order (attaches its shared memory when
        shm may come first; starts this process's TE when the peer offers Mooncake)."""
        shm_attaches = prefer_shm and transport in ("auto", SHM) and self._reader(info) is not None
        mooncake_here = (
            transport in ("auto", MOONCAKE)
            and bool(info.mooncake_session)
            and time.monotonic() >= self._mooncake_down.get(info.region, 0.0)
            and te.engine() is not None
        )
        return transport_order(transport, info.transports, shm_attaches, mooncake_here)

    async def _pull(
        self,
        region: str,
        digests: Sequence[bytes],
        outs: Sequence[memoryview],
        layout: str,
        ttl_ms: int,
        timeout_s: float,
        prefer_shm: bool,
        lease: Lease | None,
        transport: str,
        stats: PullStats,
    ) -> PullStats:
        start = time.monotonic()
        info = await self.describe(region, timeout_s)
        if info.layout != layout:
            raise PullFailed("layout", f"peer region holds {info.layout!r}, this worker needs {layout!r}")
        left = lambda: max(0.001, timeout_s - (time.monotonic() - start))  # noqa: E731
        order = self.transports(info, transport, prefer_shm)
        if order[0] == GRPC and lease is None:
            return await self.read_digests(region, digests, outs[: len(digests)], ttl_ms, left(), stats)
        if lease is None:
            lease = await self.acquire_lease(region, digests, ttl_ms, left())
        if order[0] != GRPC and lease.region_id and lease.region_id != info.region_id:
            info = await self._redescribe(region, left())  # the peer's region was replaced (restart)
            order = self.transports(info, transport, prefer_shm)
            if order[0] != GRPC and info.region_id != lease.region_id:
                raise PullFailed("stale", "the peer's region changed while pulling")
        count = lease.prefix
        stats.transport = order[0]
        if count == 0:
            return stats
        if order[0] == SHM:
            reader = self._readers.get(region)
            assert reader is not None  # shm comes first only when it attached
            return _read_shm(reader, lease, outs, count, stats)
        if order[0] == MOONCAKE:
            try:
                return await self._read_mooncake(info, lease, outs, count, stats)
            except te.TransferFailed as e:  # the bytes did not move: the same lease, over gRPC
                log.warning("kv-sync: mooncake read of %r failed, pulling over gRPC: %s", region, e)
                self._mooncake_down[region] = time.monotonic() + MOONCAKE_RETRY_S
                stats.transport = GRPC
        await self.read_blocks(lease, outs, count, left(), stats)
        if time.monotonic() > lease.deadline:  # the owner may have reused a slot after the server's checks
            stats.discard()  # which block that hit is unknown: keep none
            raise PullFailed("expired", f"the lease ended before the {count} blocks were copied")
        return stats

    async def _read_mooncake(
        self, info: RegionInfo, lease: Lease, outs: Sequence[memoryview], count: int, stats: PullStats
    ) -> PullStats:
        """One TE batch of the leased blocks' slot headers and data, then each block checked in order (the
        header's generation and digest are the leased ones, CRC32C of the copy equals the header's), counted
        in `stats` as each passes. The data lands in `outs` directly when they lie in memory registered with
        this process's TE, else in a staging arena that `copy_checksum` copies out of in the checking pass.
        Raises `te.TransferFailed` (nothing counted) when the bytes did not move."""
        engine = te.engine()
        if engine is None:
            raise te.TransferFailed("no transfer engine in this process")
        if time.monotonic() >= lease.deadline:
            raise PullFailed("expired", "the lease ended before the read")
        refs = [ref for ref in lease.refs[:count] if ref is not None]
        assert len(refs) == count  # `count` is the lease's held prefix
        sizes = [min(info.block_bytes, len(out)) for out in outs[:count]]
        addresses = [te.buffer_address(out) for out in outs[:count]]
        direct = engine.registered_all(addresses, sizes)
        heads = count * SLOT_HEADER_BYTES
        base = info.mooncake_base
        with engine.arena(heads + (0 if direct else sum(sizes))) as arena:
            # headers land back to back at the arena's start; the data in `outs`, or after them in the arena
            if not direct:
                addresses = list(itertools.accumulate(sizes[:-1], initial=arena.address + heads))
            headers_at = base + slot_header_offset(0)
            data_at = base + slot_data_offset(info.block_bytes, info.num_slots, 0)
            local = [arena.address + i * SLOT_HEADER_BYTES for i in range(count)] + addresses
            remote = [headers_at + ref.slot * SLOT_HEADER_BYTES for ref in refs]
            remote += [data_at + ref.slot * info.block_bytes for ref in refs]
            pieces = [SLOT_HEADER_BYTES] * count + sizes
            await engine.read(info.mooncake_session, local, remote, pieces, None if direct else arena)
            if time.monotonic() > lease.deadline:  # the owner may have reused a slot during the read
                raise PullFailed("expired", f"the lease ended before the {count} blocks were copied")
            at = heads
            for i, (generation, digest, length, crc) in enumerate(iter_slot_headers(arena.view[:heads])):
                if generation != refs[i].generation or digest != lease.digests[i] or length == 0:
                    raise StaleBlock(f"slot {refs[i].slot} no longer holds the leased block {i}")
                if length > sizes[i]:
                    raise FailedPrecondition(f"block {i} ({length} B) is larger than its buffer ({sizes[i]} B)")
                dest = outs[i][:length]
                got = checksum(dest) if direct else copy_checksum(dest, arena.view[at : at + length])
                at += 0 if direct else sizes[i]
                if got != crc:
                    raise CorruptBlock(f"integrity check failed for block {digest.hex()[:16]}: CRC32C mismatch")
                stats.add(length, crc)
        return stats

    async def _redescribe(self, region: str, timeout_s: float) -> RegionInfo:
        """Forgets the cached description and mapping of `region`, then describes it again."""
        self._described.pop(region, None)
        self._mooncake_down.pop(region, None)
        old = self._readers.pop(region, None)
        if old is not None:
            old.close()
        return await self.describe(region, timeout_s)

    def close(self) -> None:
        """Unmaps the peers' regions this client attached."""
        for reader in self._readers.values():
            if reader is not None:
                reader.close()
        self._readers.clear()


def _read_shm(
    reader: RegionReader, lease: Lease, outs: Sequence[memoryview], count: int, stats: PullStats
) -> PullStats:
    """One-sided copies of the leased blocks (each: generation before/after, digest, CRC32C checked in the
    same pass as the copy), counted in `stats` as each completes."""
    for i in range(count):
        ref = lease.refs[i]
        assert ref is not None
        if time.monotonic_ns() >= lease.lease_until_ns:
            raise PullFailed("expired", f"the lease ended at block {i} of {count}")
        stats.add(*reader.read_checked(ref, lease.digests[i], outs[i]))
    return stats


class BlockAssembly:
    """Blocks arriving in chunks, copied into their buffers with the CRC32C computed in the copy's pass
    (continued from chunk to chunk) and compared with the block's CRC on its last chunk. `verify=False`: the
    same copies unchecked (`bench kvsync` measures the check's cost as the difference)."""

    def __init__(self, outs: Sequence[memoryview], count: int, stats: PullStats, verify: bool = True) -> None:
        self.outs = outs
        self.count = count
        self.stats = stats
        self.verify = verify
        self.index = 0
        self.filled = 0
        self.crc = 0  # CRC32C of the current block's first `filled` bytes

    def add(self, chunk: Chunk) -> None:
        if chunk.index != self.index or chunk.offset != self.filled or self.index >= self.count:
            raise FailedPrecondition(f"out-of-order chunk (block {chunk.index} offset {chunk.offset})")
        out = self.outs[self.index]
        end = self.filled + len(chunk.data)
        if end > len(out):
            raise FailedPrecondition(f"block {self.index} is larger than its buffer ({len(out)} bytes)")
        if self.verify:
            self.crc = copy_checksum(out[self.filled : end], chunk.data, self.crc)
        else:
            out[self.filled : end] = chunk.data
        self.filled = end
        if chunk.last:
            if self.verify and self.crc != chunk.crc32c:
                raise CorruptBlock(f"integrity check failed for block {self.index}: CRC32C mismatch")
            self.stats.add(end, chunk.crc32c)  # verified: equal to the CRC of this copy
            self.index += 1
            self.filled = 0
            self.crc = 0

    def finish(self) -> None:
        if self.index != self.count:
            raise FailedPrecondition(f"stream ended after {self.index} of {self.count} blocks")
