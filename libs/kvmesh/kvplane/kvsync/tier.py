"""A worker's shared-memory KV tier, fit for one-sided access (pure: no gRPC, no asyncio, no clocks).

One POSIX shared-memory segment per region, one writer (the owner, `TierRegion`), any number of readers on
the host (`RegionReader`, attached by name). Time enters as `now_ns` / `until_ns`: every process that shares
a region must use the same clock, `time.monotonic_ns()` (CLOCK_MONOTONIC is host-wide on Linux).

Segment layout (little-endian)::

    0        region header, 4096 B: magic b"KVMR" | version u32 | block_bytes u64 | num_slots u64 |
             epoch u64 | layout_len u32 | pad | region_id 16 B at 40 (random) | layout (UTF-8, <= 256 B) at 64
    4096     slot headers, num_slots x 64 B: generation u64 | digest 32 B | length u32 | crc32c u32 | 16 B spare
    ...      lease array, num_slots x u64 lease_until_ns (written only by the lessor)
    data     num_slots x block_bytes, the data area starting 4096-aligned

Writes follow a seqlock: the owner makes the slot's generation odd, writes header and data, makes it even
again and bumps the region epoch; a reader checks the generation before and after its copy, so it either
copies a stable block or raises `StaleBlock`. The CRC32C is computed once, when the block is written, and
checked by the reader on its own copy (`CorruptBlock`). `put` copies and checksums; `reserve` / `publish`
let a writer fill the slot itself (e.g. a gRPC receive copy that computed the CRC in its pass) and publish
that CRC, and `abort` frees a reserved slot unpublished. A slot whose lease is in the future is never reused;
a lease taken in the instant the owner reuses the slot is caught by the generation check.

Neither class is thread-safe: call an owner's methods from one thread (a lessor in the owner's process, e.g.
KvSyncServicer on the worker's event loop, leases on that same thread).
"""

from __future__ import annotations

import contextlib
import heapq
import mmap
import os
import re
import struct
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from multiprocessing import shared_memory
from typing import Protocol

import crc32c
import numpy as np
import numpy.typing as npt

from kvmesh.core.errors import FailedPrecondition, InvalidArgument, NotFound

try:  # the optional C kernel (setup.py builds it; absent where the CPU has no SSE4.2)
    from kvmesh.kvplane.kvsync import _crc

    _kernel = _crc if _crc.available else None
except ImportError:
    _kernel = None

MAGIC = b"KVMR"
VERSION = 1
HEADER_BYTES = 4096
SLOT_HEADER_BYTES = 64
DIGEST_BYTES = 32
MAX_LAYOUT_BYTES = 256
PAGE = 4096
SHM_DIR = "/dev/shm"  # where Linux keeps POSIX shared memory
_OWNED_NAME = re.compile(r"kvmesh-(\d+)-[\w.-]+")  # region_name(): the owner's pid, then a tag


def region_name(tag: str, pid: int | None = None) -> str:
    """`kvmesh-<pid>-<tag>`: a region name that says which process owns it, so that a region left behind by
    an owner killed with SIGKILL (which cannot unlink it) is found and removed by `remove_orphans`."""
    return f"kvmesh-{os.getpid() if pid is None else pid}-{tag}"


def remove_orphans(shm_dir: str = SHM_DIR) -> list[str]:
    """Unlinks the regions named by `region_name` whose owner process no longer exists; returns their names.
    (A process in another PID namespace sharing this /dev/shm would look dead: such hosts name regions
    otherwise.) Readers that still map an orphan keep their mapping; new attaches get NOT_FOUND."""
    removed: list[str] = []
    for name in os.listdir(shm_dir) if os.path.isdir(shm_dir) else ():
        m = _OWNED_NAME.fullmatch(name)
        if m is None or _alive(int(m.group(1))):
            continue
        with contextlib.suppress(FileNotFoundError):
            os.unlink(os.path.join(shm_dir, name))
            removed.append(name)
    return removed


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # it exists, owned by another user
        return True
    return True


_HEAD = struct.Struct("<4sIQQQI")  # magic, version, block_bytes, num_slots, epoch, layout_len
_EPOCH_OFFSET = 24
_REGION_ID_OFFSET = 40
REGION_ID_BYTES = 16
_LAYOUT_OFFSET = 64
_SLOT = np.dtype([("generation", "<u8"), ("digest", "V32"), ("length", "<u4"), ("crc32c", "<u4"), ("spare", "V16")])


def checksum(data: bytes | memoryview) -> int:
    """CRC32C (Castagnoli) of a block: kvmesh's interleaved SSE4.2 kernel, else the `crc32c` package."""
    if _kernel is not None:
        return int(_kernel.crc32c(data))
    return int(crc32c.crc32c(data))


def copy_checksum(dest: memoryview, src: memoryview, value: int = 0) -> int:
    """Copies `src` into `dest` (equal lengths) and returns the CRC32C of the bytes copied, continuing `value`
    (the CRC32C of the bytes before them, for a block copied in pieces). With the kernel it is one pass: each
    word is checked from the register it was loaded into, so the source is read once; without, a copy and
    then a CRC over the copy."""
    if _kernel is not None:
        return int(_kernel.copy_crc32c(dest, src, value))
    dest[:] = src
    return int(crc32c.crc32c(dest, value))


@dataclass(frozen=True)
class SlotRef:
    """Where a block sat when it was located: its slot and the slot's (even) generation then."""

    slot: int
    generation: int


@dataclass(frozen=True, eq=False)
class Reservation:
    """A slot reserved for `digest` by `TierRegion.reserve`: its generation is odd (no reader can copy it),
    `data` is the whole slot (`block_bytes`), writable until `publish` or `abort`, which release it (a late
    write raises ValueError)."""

    slot: int
    digest: bytes
    data: memoryview  # released by publish / abort


class StaleBlock(FailedPrecondition):
    """The slot was reused, or is being written, under the reader: the block is gone; recompute it."""


class CorruptBlock(FailedPrecondition):
    """The copied bytes do not match the CRC32C written with the block: integrity check failed."""


def data_offset(num_slots: int) -> int:
    """Byte offset of the data area: after the header, slot headers and leases, 4096-aligned."""
    end = HEADER_BYTES + num_slots * (SLOT_HEADER_BYTES + 8)
    return -(-end // PAGE) * PAGE


def segment_bytes(block_bytes: int, num_slots: int) -> int:
    """Size of a region's shared-memory segment."""
    return data_offset(num_slots) + block_bytes * num_slots


def slot_header_offset(slot: int) -> int:
    """Byte offset of a slot's header in the segment."""
    return HEADER_BYTES + slot * SLOT_HEADER_BYTES


def slot_data_offset(block_bytes: int, num_slots: int, slot: int) -> int:
    """Byte offset of a slot's data in the segment."""
    return data_offset(num_slots) + slot * block_bytes


_SLOT_HEADER = struct.Struct("<Q32sII")  # generation, digest, length, crc32c (the first 48 of a header's 64 B)
_SLOT_HEADERS = struct.Struct(f"<Q32sII{SLOT_HEADER_BYTES - _SLOT_HEADER.size}x")  # a whole header, spare skipped


def iter_slot_headers(raw: bytes | memoryview) -> Iterator[tuple[int, bytes, int, int]]:
    """(generation, digest, length, CRC32C) of each slot header copied out of a region back to back into
    `raw` (a one-sided read of many, from another host, which sees the bytes but not the region's numpy
    views): one C loop (`struct.iter_unpack`; for 32 headers ~5x faster than unpacking each alone, and than
    numpy's structured views, whose fixed cost dominates that few)."""
    return _SLOT_HEADERS.iter_unpack(raw)


class _Segment(Protocol):
    """A mapped shared-memory segment (the owner's `SharedMemory`, or a reader's `_Attached`)."""

    @property
    def name(self) -> str: ...
    @property
    def buf(self) -> memoryview | None: ...
    def close(self) -> None: ...


class _Mapped:
    """The numpy views over one mapped segment that owner and readers share."""

    shm_name: str
    block_bytes: int
    num_slots: int
    layout: str

    def _map(self, shm: _Segment) -> None:
        buf = shm.buf
        assert buf is not None
        self._shm = shm
        self._buf: memoryview = buf
        n = self.num_slots
        self._slots: npt.NDArray[np.void] = np.ndarray((n,), dtype=_SLOT, buffer=buf, offset=HEADER_BYTES)
        self._gen: npt.NDArray[np.uint64] = self._slots["generation"]
        self._length: npt.NDArray[np.uint32] = self._slots["length"]
        self._crc: npt.NDArray[np.uint32] = self._slots["crc32c"]
        self._leases: npt.NDArray[np.uint64] = np.ndarray(
            (n,), dtype="<u8", buffer=buf, offset=HEADER_BYTES + n * SLOT_HEADER_BYTES
        )
        self._epoch: npt.NDArray[np.uint64] = np.ndarray((1,), dtype="<u8", buffer=buf, offset=_EPOCH_OFFSET)
        self._data_start = data_offset(n)

    @property
    def segment(self) -> memoryview:
        """The whole mapped segment (what a transfer engine registers for one-sided reads by peers)."""
        return self._buf

    @property
    def region_id(self) -> bytes:
        """The region's random identity, written at creation (tells two same-named segments apart)."""
        return bytes(self._buf[_REGION_ID_OFFSET : _REGION_ID_OFFSET + REGION_ID_BYTES])

    @property
    def epoch(self) -> int:
        """The region's change counter (bumped by the owner on every slot change)."""
        return int(self._epoch[0])

    def _data(self, slot: int, length: int) -> memoryview:
        start = self._data_start + slot * self.block_bytes
        return self._buf[start : start + length]

    def _digest(self, slot: int) -> bytes:
        start = HEADER_BYTES + slot * SLOT_HEADER_BYTES + 8
        return bytes(self._buf[start : start + DIGEST_BYTES])

    def _check_slot(self, slot: int) -> None:
        if not 0 <= slot < self.num_slots:
            raise InvalidArgument("slot", f"must be in [0, {self.num_slots}), got {slot}")

    def lease(self, refs: Sequence[SlotRef], until_ns: int) -> None:
        """Leases the slots until `until_ns` (never shortens a lease); only the lessor process calls this.

        Raises StaleBlock if a slot no longer holds the ref's generation once leased (the lease on it is
        then useless; the others stay).
        """
        for ref in refs:
            self._check_slot(ref.slot)
            if int(self._leases[ref.slot]) < until_ns:
                self._leases[ref.slot] = until_ns
        for ref in refs:  # after writing the leases: a reuse the owner began before seeing them shows here
            if int(self._gen[ref.slot]) != ref.generation:
                raise StaleBlock(f"slot {ref.slot} was reused before its lease took hold")

    def release_leases(self, slots: Sequence[int], held_ns: int, until_ns: Sequence[int]) -> int:
        """Lowers each slot's lease from `held_ns` to its `until_ns` (the lessor ending a lease of its own
        early, `until_ns` being the latest other lease it granted there), except where the lease is no longer
        `held_ns` (a later lease extended it: it stays); returns how many were lowered."""
        idx = np.asarray(slots, dtype=np.int64)
        if idx.size and (int(idx.min()) < 0 or int(idx.max()) >= self.num_slots):
            raise InvalidArgument("slots", f"must be in [0, {self.num_slots})")
        new = np.asarray(until_ns, dtype=np.uint64)
        lower = (self._leases[idx] == np.uint64(held_ns)) & (new < np.uint64(held_ns))
        self._leases[idx[lower]] = new[lower]
        return int(lower.sum())

    def view(self, ref: SlotRef, digest: bytes) -> tuple[memoryview, int]:
        """(the block's bytes in the region, its CRC32C), no copy; StaleBlock if the slot no longer holds
        `digest` at `ref.generation`. The view is only good while `unchanged(ref)`: check it after use."""
        self._check_slot(ref.slot)
        slot = ref.slot
        if int(self._gen[slot]) != ref.generation or ref.generation % 2:
            raise StaleBlock(f"slot {slot} no longer holds generation {ref.generation}")
        length = int(self._length[slot])
        crc = int(self._crc[slot])
        if length == 0 or self._digest(slot) != digest:
            raise StaleBlock(f"slot {slot} holds another block than {digest.hex()[:16]}")
        return self._data(slot, length), crc

    def unchanged(self, ref: SlotRef) -> bool:
        """Whether the slot still holds the generation of `ref` (the seqlock's closing check)."""
        return int(self._gen[ref.slot]) == ref.generation

    def lease_until(self, slot: int) -> int:
        """The slot's lease expiry (0: never leased)."""
        self._check_slot(slot)
        return int(self._leases[slot])

    def _release(self) -> None:
        for name in ("_slots", "_gen", "_length", "_crc", "_leases", "_epoch"):
            self.__dict__.pop(name, None)
        self.__dict__.pop("_buf", None)
        with contextlib.suppress(BufferError):  # a caller still holds a view from get(): it keeps the map
            self._shm.close()


def _validate_digest(digest: bytes) -> None:
    if len(digest) != DIGEST_BYTES:
        raise InvalidArgument("digest", f"must be {DIGEST_BYTES} bytes, got {len(digest)}")


class TierRegion(_Mapped):
    """The owner (single writer) of one region: stores blocks, evicts LFU+LRU, never reuses a leased slot.

    Eviction picks, among stored unleased slots, the fewest hits, then the oldest last use (LFU, ties by
    LRU). Free slots are used first.
    """

    @classmethod
    def create(cls, shm_name: str, block_bytes: int, num_slots: int, layout: str) -> TierRegion:
        """Creates the segment `shm_name` (it must not exist) and formats it, first removing the regions of
        owners that died without unlinking theirs (`remove_orphans`)."""
        if block_bytes <= 0:
            raise InvalidArgument("block_bytes", f"must be > 0, got {block_bytes}")
        if num_slots <= 0:
            raise InvalidArgument("num_slots", f"must be > 0, got {num_slots}")
        raw = layout.encode()
        if not raw or len(raw) > MAX_LAYOUT_BYTES:
            raise InvalidArgument("layout", f"must be 1..{MAX_LAYOUT_BYTES} bytes of UTF-8, got {len(raw)}")
        remove_orphans()
        shm = shared_memory.SharedMemory(name=shm_name, create=True, size=segment_bytes(block_bytes, num_slots))
        assert shm.buf is not None
        shm.buf[: _HEAD.size] = _HEAD.pack(MAGIC, VERSION, block_bytes, num_slots, 0, len(raw))
        shm.buf[_REGION_ID_OFFSET : _REGION_ID_OFFSET + REGION_ID_BYTES] = os.urandom(REGION_ID_BYTES)
        shm.buf[_LAYOUT_OFFSET : _LAYOUT_OFFSET + len(raw)] = raw
        return cls(shm, block_bytes, num_slots, layout)

    def __init__(self, shm: shared_memory.SharedMemory, block_bytes: int, num_slots: int, layout: str) -> None:
        self.shm_name = shm.name
        self.block_bytes = block_bytes
        self.num_slots = num_slots
        self.layout = layout
        self._owned = shm
        self._map(shm)
        self._where: dict[bytes, int] = {}
        self._held: list[bytes | None] = [None] * num_slots
        self._hits = [0] * num_slots
        self._last = [0] * num_slots
        # (hits, last use, slot) per put / touch; entries no longer matching the slot are skipped (lazy)
        self._order: list[tuple[int, int, int]] = []
        self._free = list(range(num_slots - 1, -1, -1))
        self._evicted: list[bytes] = []
        self._reserved: dict[int, Reservation] = {}  # slot -> its reservation: neither free nor held

    def __len__(self) -> int:
        return len(self._where)

    def put(self, digest: bytes, data: bytes | memoryview, now_ns: int) -> bool:
        """Stores a block (its CRC32C computed here, once); an already-held digest is just touched.

        When full, evicts the LFU+LRU unleased victim; False when every slot is leased.
        """
        _validate_digest(digest)
        if not 0 < len(data) <= self.block_bytes:
            raise InvalidArgument("data", f"must be 1..{self.block_bytes} bytes, got {len(data)}")
        if self._touch(digest, now_ns):
            return True
        slot = self._take_slot(now_ns)
        if slot is None:
            return False
        length = len(data)
        self._data(slot, length)[:] = data
        self._publish(slot, digest, length, checksum(data))
        self._hold(slot, digest, now_ns)
        return True

    def reserve(self, digest: bytes, now_ns: int) -> Reservation | None:
        """A slot for `digest`, to be filled through `Reservation.data` and then `publish`ed (or `abort`ed).

        The slot is taken as `put` takes one (free first, else the LFU+LRU unleased victim, evicted now); its
        generation stays odd and its header empty until `publish`, so no reader copies or locates it. None
        when every slot is leased or reserved. Several reservations may be open at once.
        """
        _validate_digest(digest)
        slot = self._take_slot(now_ns)
        if slot is None:
            return None
        self._clear_header(slot)
        self._epoch[0] += 1  # readers' locate caches drop an evicted victim now, not at publish
        res = self._reserved[slot] = Reservation(slot, digest, self._data(slot, self.block_bytes))
        return res

    def publish(self, res: Reservation, length: int, crc: int, now_ns: int) -> SlotRef:
        """Makes a reserved block visible with the CRC32C its writer computed over `data[:length]` (not
        recomputed: the caller's copy checked it); returns its ref. If `res.digest` was stored meanwhile (a
        `put`, another reservation), this one is aborted and the stored copy's ref returned."""
        self._check_reserved(res)
        if not 0 < length <= self.block_bytes:
            raise InvalidArgument("length", f"must be 1..{self.block_bytes}, got {length}")
        held = self._where.get(res.digest)
        if held is not None:
            self.abort(res)
            return SlotRef(held, int(self._gen[held]))
        self._end(res)
        self._publish(res.slot, res.digest, length, crc)
        self._hold(res.slot, res.digest, now_ns)
        return SlotRef(res.slot, int(self._gen[res.slot]))

    def abort(self, res: Reservation) -> None:
        """Frees a reserved slot unpublished: generation even again (two past any block it held before, so a
        reader's old ref fails), header empty, the slot free."""
        self._check_reserved(res)
        self._end(res)
        self._gen[res.slot] += 1
        self._epoch[0] += 1
        self._free.append(res.slot)

    def _check_reserved(self, res: Reservation) -> None:
        if self._reserved.get(res.slot) is not res:
            raise FailedPrecondition(f"slot {res.slot} is not reserved by this reservation (published or aborted)")

    def _end(self, res: Reservation) -> None:
        """Ends the reservation and its view: a late write raises, and the view no longer pins the mapping."""
        del self._reserved[res.slot]
        with contextlib.suppress(BufferError):  # a buffer taken from the view is still open: it stays usable
            res.data.release()

    def _hold(self, slot: int, digest: bytes, now_ns: int) -> None:
        self._where[digest] = slot
        self._held[slot] = digest
        self._hits[slot] = 1
        self._last[slot] = now_ns
        self._push(slot)

    def _push(self, slot: int) -> None:
        heapq.heappush(self._order, (self._hits[slot], self._last[slot], slot))
        if len(self._order) > 4 * self.num_slots + 64:  # compact: one entry per held slot
            self._order = [(self._hits[i], self._last[i], i) for i, d in enumerate(self._held) if d is not None]
            heapq.heapify(self._order)

    def _touch(self, digest: bytes, now_ns: int) -> bool:
        slot = self._where.get(digest)
        if slot is None:
            return False
        self._hits[slot] += 1
        self._last[slot] = max(self._last[slot], now_ns)
        self._push(slot)
        return True

    def _take_slot(self, now_ns: int) -> int | None:
        """A free slot, or the slot of the evicted LFU+LRU unleased victim (marked odd: being written)."""
        if self._free:
            slot = self._free.pop()
            self._gen[slot] += 1
            return slot
        kept: list[tuple[int, int, int]] = []
        victim = None
        while self._order:  # bounded: every pass pops one entry
            entry = heapq.heappop(self._order)
            hits, last, slot = entry
            if self._held[slot] is None or (self._hits[slot], self._last[slot]) != (hits, last):
                continue  # outdated: the slot has a newer entry, or is empty
            if int(self._leases[slot]) > now_ns:
                kept.append(entry)
                continue
            self._gen[slot] += 1  # odd: readers now fail on it
            if int(self._leases[slot]) > now_ns:  # a lease landed between the check and the mark: keep it
                self._gen[slot] -= 1
                kept.append(entry)
                continue
            victim = slot
            break
        for entry in kept:
            heapq.heappush(self._order, entry)
        if victim is not None:
            self._forget(victim)
        return victim

    def _forget(self, slot: int) -> None:
        digest = self._held[slot]
        assert digest is not None
        del self._where[digest]
        self._held[slot] = None
        self._evicted.append(digest)

    def _publish(self, slot: int, digest: bytes, length: int, crc: int) -> None:
        """Writes the header of a slot whose generation is odd and data is in place, then makes it visible
        (generation even, epoch bumped)."""
        head = HEADER_BYTES + slot * SLOT_HEADER_BYTES
        self._buf[head + 8 : head + 8 + DIGEST_BYTES] = digest
        self._length[slot] = length
        self._crc[slot] = crc
        self._gen[slot] += 1
        self._epoch[0] += 1

    def _clear_header(self, slot: int) -> None:
        self._length[slot] = 0
        head = HEADER_BYTES + slot * SLOT_HEADER_BYTES
        self._buf[head + 8 : head + 8 + DIGEST_BYTES] = bytes(DIGEST_BYTES)

    def get(self, digest: bytes, now_ns: int) -> memoryview | None:
        """A view of the block's data (valid until the slot is reused), counting a hit; None if absent."""
        slot = self._where.get(digest)
        if slot is None:
            return None
        self._touch(digest, now_ns)
        return self._data(slot, int(self._length[slot]))

    def contains_prefix(self, digests: Sequence[bytes]) -> int:
        """How many leading digests the region holds."""
        for i, digest in enumerate(digests):
            if digest not in self._where:
                return i
        return len(digests)

    def locate(self, digests: Sequence[bytes]) -> list[SlotRef | None]:
        """Each digest's slot and generation, None where absent."""
        out: list[SlotRef | None] = []
        for digest in digests:
            slot = self._where.get(digest)
            out.append(None if slot is None else SlotRef(slot, int(self._gen[slot])))
        return out

    def leased(self, digest: bytes, now_ns: int) -> bool:
        """Whether the block's slot is under a lease at `now_ns`."""
        slot = self._where.get(digest)
        return slot is not None and int(self._leases[slot]) > now_ns

    def evict(self, digest: bytes, now_ns: int | None = None) -> bool:
        """Frees the block's slot; False if absent, or if leased at `now_ns` (when given)."""
        slot = self._where.get(digest)
        if slot is None or (now_ns is not None and int(self._leases[slot]) > now_ns):
            return False
        self._gen[slot] += 1
        self._forget(slot)
        self._clear_header(slot)
        self._gen[slot] += 1
        self._epoch[0] += 1
        self._free.append(slot)
        return True

    def drain_evicted(self) -> list[bytes]:
        """Digests evicted since the last call (for BlockRemoved events)."""
        out, self._evicted = self._evicted, []
        return out

    def close(self, unlink: bool = True) -> None:
        """Unmaps the segment, and removes it from the host when `unlink` (open reservations end unpublished)."""
        for res in list(self._reserved.values()):
            self._end(res)
        self._release()
        if unlink:
            with contextlib.suppress(FileNotFoundError):
                self._owned.unlink()


class RegionReader(_Mapped):
    """Any process on the host: attaches a region by name and copies blocks out, one-sided.

    `locate` scans the slot headers (numpy) and caches digest -> slot; the cache is reused while the
    region's epoch is unchanged and, when it changed, only slots whose generation moved are re-read.
    """

    @classmethod
    def attach(cls, shm_name: str, expect_layout: str | None = None) -> RegionReader:
        """Maps an existing region; NotFound if there is none, FailedPrecondition on a foreign format or
        (when `expect_layout` is given) a different layout: such blocks must never be exchanged."""
        shm = _Attached(shm_name)
        try:
            reader = cls(shm)
        except Exception:
            shm.close()
            raise
        if expect_layout is not None and reader.layout != expect_layout:
            reader.close()
            raise FailedPrecondition(
                f"layout mismatch: region {shm_name!r} holds {reader.layout!r}, expected {expect_layout!r}"
            )
        return reader

    def __init__(self, shm: _Segment) -> None:
        buf = shm.buf
        assert buf is not None
        if len(buf) < HEADER_BYTES:
            raise FailedPrecondition(f"{shm.name!r} is not a kv-sync region (too small)")
        magic, version, block_bytes, num_slots, _epoch, layout_len = _HEAD.unpack_from(buf)
        if magic != MAGIC or version != VERSION or layout_len > MAX_LAYOUT_BYTES:
            raise FailedPrecondition(f"{shm.name!r} is not a kv-sync region of version {VERSION}")
        if len(buf) < segment_bytes(block_bytes, num_slots):
            raise FailedPrecondition(f"{shm.name!r} is shorter than its header says")
        self.shm_name = shm.name
        self.block_bytes = block_bytes
        self.num_slots = num_slots
        self.layout = bytes(buf[_LAYOUT_OFFSET : _LAYOUT_OFFSET + layout_len]).decode()
        self._map(shm)
        self._cached_epoch = -1
        self._cached_gen = np.zeros(num_slots, dtype=np.uint64)
        self._by_digest: dict[bytes, int] = {}
        self._slot_digest: list[bytes | None] = [None] * num_slots

    def _refresh(self) -> None:
        epoch = self.epoch
        if epoch == self._cached_epoch:
            return
        gens = self._gen.copy()
        for slot in np.flatnonzero(gens != self._cached_gen).tolist():
            old = self._slot_digest[slot]
            if old is not None and self._by_digest.get(old) == slot:
                del self._by_digest[old]
            self._slot_digest[slot] = None
            if gens[slot] % 2 == 0 and self._length[slot] > 0:
                digest = self._digest(slot)
                if int(self._gen[slot]) != int(gens[slot]):  # rewritten while read: the next scan sees it
                    continue
                self._slot_digest[slot] = digest
                self._by_digest[digest] = slot
        self._cached_gen = gens
        self._cached_epoch = epoch

    def locate(self, digests: Sequence[bytes]) -> list[SlotRef | None]:
        """Each digest's slot and generation as the headers say now (a hint: read_into re-checks)."""
        self._refresh()
        out: list[SlotRef | None] = []
        for digest in digests:
            slot = self._by_digest.get(digest)
            out.append(None if slot is None else SlotRef(slot, int(self._cached_gen[slot])))
        return out

    def published(self) -> list[tuple[bytes, SlotRef]]:
        """Every block published now, in slot order: (digest, its slot and generation) (a hint, as `locate`'s;
        for tools that inspect a region: the chaos campaign, audits)."""
        self._refresh()
        return [
            (digest, SlotRef(slot, int(self._cached_gen[slot])))
            for digest, slot in sorted(self._by_digest.items(), key=lambda kv: kv[1])
        ]

    def generation(self, slot: int) -> int:
        """The slot's generation now (odd: a write under way)."""
        self._check_slot(slot)
        return int(self._gen[slot])

    def writes_under_way(self) -> int:
        """Slots whose generation is odd: a write begun and not (yet) published."""
        return int((self._gen % 2 == 1).sum())

    def read_into(self, ref: SlotRef, digest: bytes, out: memoryview, verify: bool = True) -> int:
        """Copies the block into `out` (one copy) and returns its length.

        Raises StaleBlock if the slot's generation is not `ref.generation` before or after the copy, or its
        header names another digest; CorruptBlock if `verify` and the copy fails its CRC32C.
        """
        return self.read_checked(ref, digest, out, verify)[0]

    def read_checked(self, ref: SlotRef, digest: bytes, out: memoryview, verify: bool = True) -> tuple[int, int]:
        """`read_into`, returning (length, the block's CRC32C as its header holds it)."""
        src, crc = self.view(ref, digest)
        length = len(src)
        if len(out) < length:
            raise InvalidArgument("out", f"needs {length} bytes, got {len(out)}")
        dest = out[:length]
        if verify:
            got = copy_checksum(dest, src)
        else:
            dest[:] = src
        if not self.unchanged(ref):
            raise StaleBlock(f"slot {ref.slot} was reused during the copy")
        if verify and got != crc:
            raise CorruptBlock(f"integrity check failed for block {digest.hex()[:16]}: CRC32C mismatch")
        return length, crc

    def close(self) -> None:
        """Unmaps the region (the owner keeps it)."""
        self._release()


class _Attached:
    """An existing segment mapped by name, outside `multiprocessing`'s resource tracker (which, before
    Python 3.13, would unlink the owner's region when this reader exits)."""

    def __init__(self, name: str) -> None:
        self.name = name.lstrip("/")
        try:
            fd = os.open(os.path.join(SHM_DIR, self.name), os.O_RDWR)
        except FileNotFoundError:
            raise NotFound(f"no kv-sync region {name!r} on this host") from None
        try:
            size = os.fstat(fd).st_size
            if size == 0:
                raise FailedPrecondition(f"{name!r} is not a kv-sync region (empty)")
            self._mmap = mmap.mmap(fd, size)
        finally:
            os.close(fd)
        self.buf: memoryview | None = memoryview(self._mmap)

    def close(self) -> None:
        if self.buf is not None:
            self.buf.release()
            self.buf = None
        self._mmap.close()
