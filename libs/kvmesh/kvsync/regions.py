"""Registered memory regions of KV blocks: the RDMA-style side of kv-sync, free of gRPC.

A region is a contiguous buffer of `num_blocks` slots of `block_bytes` each, backed by POSIX shared memory
when a name is given (a peer on the same host attaches it and copies straight from it: one copy, no
serialisation) or by anonymous memory otherwise. Blocks are addressed by their *data identity* — the chained
sha256 digest of `kvmesh.hashing.sha256_block_ids`, never the fast routing hash — so a collision cannot hand
one tenant's cache to another. Reads return `memoryview`s of the region (zero-copy until the transport);
writes land in a free slot and are verified with CRC32C before they become visible.
"""

from __future__ import annotations

import secrets
from dataclasses import dataclass, field
from multiprocessing import shared_memory

import crc32c

from kvmesh.errors import FailedPrecondition, InvalidArgument, NotFound, ResourceExhausted

DIGEST_BYTES = 32


def checksum(data: bytes | memoryview) -> int:
    """CRC32C (Castagnoli) of a block, hardware-accelerated where the CPU has it."""
    return int(crc32c.crc32c(data))


@dataclass
class MemoryRegion:
    """One registered region. `slots` maps a block digest to its slot; `free` lists unused slots."""

    key: str
    name: str
    block_bytes: int
    num_blocks: int
    shm: shared_memory.SharedMemory | None
    buffer: memoryview
    slots: dict[bytes, int] = field(default_factory=dict)
    free: list[int] = field(default_factory=list)

    def view(self, slot: int) -> memoryview:
        """The slot's bytes, without copying."""
        start = slot * self.block_bytes
        return self.buffer[start : start + self.block_bytes]

    def read(self, digest: bytes) -> memoryview:
        """The block with this identity (NotFound if the region does not hold it)."""
        slot = self.slots.get(digest)
        if slot is None:
            raise NotFound(f"block {digest.hex()[:16]}… is not in region {self.name!r}")
        return self.view(slot)

    def write(self, digest: bytes, data: bytes | memoryview, crc: int) -> None:
        """Stores a block after verifying its CRC32C; an existing block with the same identity is kept."""
        if len(digest) != DIGEST_BYTES:
            raise InvalidArgument("block.digest", f"must be {DIGEST_BYTES} bytes, got {len(digest)}")
        if len(data) != self.block_bytes:
            raise InvalidArgument("data", f"block must be {self.block_bytes} bytes, got {len(data)}")
        if checksum(data) != crc:
            raise FailedPrecondition(f"integrity check failed for block {digest.hex()[:16]}…: CRC32C mismatch")
        if digest in self.slots:
            return
        if not self.free:
            raise ResourceExhausted(f"region {self.name!r} is full ({self.num_blocks} blocks)", retry_after_s=1.0)
        slot = self.free.pop()
        self.view(slot)[:] = data
        self.slots[digest] = slot

    def evict(self, digest: bytes) -> bool:
        """Frees a block's slot; False if absent."""
        slot = self.slots.pop(digest, None)
        if slot is None:
            return False
        self.free.append(slot)
        return True

    def close(self) -> None:
        self.buffer.release()
        if self.shm is not None:
            self.shm.close()
            self.shm.unlink()


class RegionTable:
    """The regions one process exposes, by key (keys are unguessable: presenting one is the capability)."""

    def __init__(self) -> None:
        self._regions: dict[str, MemoryRegion] = {}

    def register(self, name: str, block_bytes: int, num_blocks: int, shm_name: str = "") -> MemoryRegion:
        if not name:
            raise InvalidArgument("name", "must not be empty")
        if block_bytes <= 0 or num_blocks <= 0:
            raise InvalidArgument("block_bytes" if block_bytes <= 0 else "num_blocks", "must be > 0")
        if any(r.name == name for r in self._regions.values()):
            raise FailedPrecondition(f"region {name!r} is already registered")
        size = block_bytes * num_blocks
        shm = shared_memory.SharedMemory(name=shm_name, create=True, size=size) if shm_name else None
        buffer = shm.buf if shm is not None and shm.buf is not None else memoryview(bytearray(size))
        region = MemoryRegion(
            secrets.token_hex(16), name, block_bytes, num_blocks, shm, buffer, free=list(range(num_blocks - 1, -1, -1))
        )
        self._regions[region.key] = region
        return region

    def get(self, key: str) -> MemoryRegion:
        region = self._regions.get(key)
        if region is None:
            raise NotFound("unknown region key")
        return region

    def deregister(self, key: str) -> None:
        self.get(key).close()
        del self._regions[key]

    def close(self) -> None:
        for key in list(self._regions):
            self.deregister(key)
