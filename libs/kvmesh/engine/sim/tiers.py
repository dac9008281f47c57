"""Host tiers of the simulated engine: a CPU tier (a kv-sync `TierRegion`) and an optional bounded disk tier.

Blocks the GPU pool evicts are saved here with real bytes: `block_payload(digest, block_bytes)`, a
deterministic function of the block's collision-resistant identity, so a block loaded back (or pulled from a
peer) is checked byte for byte against what this engine would have computed. The CPU tier's own evictions
are demoted to the disk tier when there is one. Every change is a KV event with its medium: a block leaving
the GPU pool is `BlockRemoved(medium="GPU")` (the pool's) followed by `BlockStored(medium="CPU")` (here).

Identity: `block_digests(tokens, block_size, salt_bytes)` = `kvmesh.index.hashing.sha256_block_ids`, where the
salt bytes cover the region's layout (model, dtype, block size, bytes per block) and the chain's salt
(LoRA adapter, tenant): two engines exchange a block only when every one of them matches.
"""

from __future__ import annotations

import os
from collections import OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import crc32c

from kvmesh.core.kvevents import MEDIUM_CPU, MEDIUM_DISK, BlockRemoved, BlockStored, KvEvent
from kvmesh.engine.sim.pool import CachedBlock
from kvmesh.index.hashing import sha256_block_ids

if TYPE_CHECKING:
    from kvmesh.kvplane.kvsync.tier import TierRegion

# K and V · layers · KV heads · head_dim · 2 bytes (bf16): the tiny model of scripts/build_tiny_model.py
TINY_KV_BYTES_PER_TOKEN = 2 * 2 * 2 * 32 * 2


def tiny_block_bytes(block_size: int) -> int:
    """Bytes of one KV block of the tiny test model (2·layers·kv_heads·head_dim·block_size·2)."""
    return TINY_KV_BYTES_PER_TOKEN * block_size


def block_payload(digest: bytes, block_bytes: int) -> bytes:
    """The stand-in KV bytes of a block: its identity repeated to `block_bytes` (any corruption shows)."""
    reps = -(-block_bytes // len(digest))
    return (digest * reps)[:block_bytes]


def salt_bytes(layout: str, chain_salt: int) -> bytes:
    """The identity salt of a chain: the region layout and the chain's (LoRA, tenant) salt."""
    return f"{layout}|{chain_salt:#x}".encode()


def block_digests(tokens: Sequence[int], block_size: int, salt: bytes) -> list[bytes]:
    """Collision-resistant identities of the full blocks of `tokens`."""
    return sha256_block_ids(tokens, block_size, salt)


def sim_layout(model: str, block_size: int, block_bytes: int) -> str:
    """The layout string of a simulated engine's regions (regions of different layouts never exchange)."""
    return f"kvmesh-sim;model={model};dtype=bf16;block_size={block_size};block_bytes={block_bytes}"


class DiskTier:
    """A bounded directory of blocks, one file per block (`<digest hex>.kv`: CRC32C u32 LE, then the bytes),
    evicted least recently used first. Same shape as `TierRegion` for `HostTiers`."""

    def __init__(self, directory: str | Path, block_bytes: int, num_slots: int) -> None:
        if num_slots < 1 or block_bytes < 1:
            raise ValueError("a disk tier needs num_slots >= 1 and block_bytes >= 1")
        self.directory = Path(directory)
        self.directory.mkdir(parents=True, exist_ok=True)
        self.block_bytes = block_bytes
        self.num_slots = num_slots
        self._lru: OrderedDict[bytes, None] = OrderedDict()
        self._evicted: list[bytes] = []
        for stale in self.directory.glob("*.kv"):  # a previous incarnation's blocks are not announced
            stale.unlink(missing_ok=True)

    def _path(self, digest: bytes) -> Path:
        return self.directory / f"{digest.hex()}.kv"

    def put(self, digest: bytes, data: bytes | memoryview, now_ns: int) -> bool:
        """Write a block (its CRC32C computed here, once), evicting the least recently used when full."""
        if digest in self._lru:
            self._lru.move_to_end(digest)
            return True
        while len(self._lru) >= self.num_slots:
            victim, _ = self._lru.popitem(last=False)
            self._path(victim).unlink(missing_ok=True)
            self._evicted.append(victim)
        tmp = self._path(digest).with_suffix(".tmp")
        with open(tmp, "wb") as f:
            f.write(int(crc32c.crc32c(data)).to_bytes(4, "little"))
            f.write(data)
        os.replace(tmp, self._path(digest))
        self._lru[digest] = None
        return True

    def get(self, digest: bytes, now_ns: int) -> memoryview | None:
        """The block's bytes if held and intact; a block failing its CRC32C is evicted and None returned."""
        if digest not in self._lru:
            return None
        try:
            raw = self._path(digest).read_bytes()
        except OSError:
            raw = b""
        data = memoryview(raw)[4:]
        if len(raw) != 4 + self.block_bytes or int.from_bytes(raw[:4], "little") != int(crc32c.crc32c(data)):
            self.evict(digest)
            self._evicted.append(digest)
            return None
        self._lru.move_to_end(digest)
        return data

    def contains_prefix(self, digests: Sequence[bytes]) -> int:
        n = 0
        for d in digests:
            if d not in self._lru:
                break
            n += 1
        return n

    def evict(self, digest: bytes) -> bool:
        if self._lru.pop(digest, 0) is None:
            self._path(digest).unlink(missing_ok=True)
            return True
        return False

    def drain_evicted(self) -> list[bytes]:
        out, self._evicted = self._evicted, []
        return out

    def close(self, unlink: bool = True) -> None:
        if unlink:
            for d in list(self._lru):
                self.evict(d)


@dataclass(slots=True)
class TierCounters:
    """Monotonic counters of the tiers (load reports carry them)."""

    saved: int = 0
    loaded_blocks: int = 0
    load_failures: int = 0
    demoted: int = 0
    dropped: int = 0


class HostTiers:
    """The CPU tier (and optional disk tier) of one simulated engine; emits their KV events.

    A block may be in the GPU pool and in a tier at once (write-through: the engine saves every block it
    computes), but the KV events announce each block in one medium only, its fastest: a tier copy is
    announced (`BlockStored(medium=CPU|DISK)`) when the GPU pool lets the block go, and withdrawn
    (`BlockRemoved`) when the block is loaded back into the pool. So the event log of every medium replays
    to a set, as every consumer (the worker's mirror, the cache-manager's index) expects.
    """

    def __init__(
        self,
        cpu: TierRegion | None,
        disk: DiskTier | None,
        layout: str,
        lease_clock_ns: Callable[[], int] | None = None,
    ) -> None:
        """`lease_clock_ns`: the clock leases are written in (the lessor's wall clock) when the engine's own
        time is simulated; slot reuse is checked against it."""
        if cpu is None and disk is None:
            raise ValueError("HostTiers needs a CPU or a disk tier")
        self.lease_clock_ns = lease_clock_ns
        self.cpu = cpu
        self.disk = disk
        self.layout = layout
        self.block_bytes = cpu.block_bytes if cpu is not None else disk.block_bytes  # type: ignore[union-attr]
        self.blocks: dict[bytes, tuple[str, CachedBlock]] = {}  # digest -> (medium, what its events describe)
        self.announced: set[bytes] = set()
        self.counters = TierCounters()
        self._events: list[KvEvent] = []

    # -- queries ---------------------------------------------------------------------------------
    def prefix_run(self, digests: Sequence[bytes]) -> int:
        """How many leading `digests` some tier holds (no side effects)."""
        n = 0
        for d in digests:
            if d not in self.blocks:
                break
            n += 1
        return n

    # -- mutations -------------------------------------------------------------------------------
    def save(self, digest: bytes, block: CachedBlock, now_ns: int, announce: bool) -> bool:
        """Keep a copy of a block (its payload bytes); `announce` when the GPU pool no longer holds it.
        True when a tier holds it."""
        now_ns = self._now(now_ns)
        if digest not in self.blocks:
            payload = block_payload(digest, self.block_bytes)
            for medium, tier in ((MEDIUM_CPU, self.cpu), (MEDIUM_DISK, self.disk)):
                if tier is not None and tier.put(digest, payload, now_ns):
                    self.blocks[digest] = (medium, block)
                    self.counters.saved += 1
                    break
            else:
                self.counters.dropped += 1
                return False
        if announce and digest not in self.announced:
            self.announced.add(digest)
            self._events.append(self._as_stored(*self.blocks[digest]))
        self._collect_evictions(now_ns)
        return digest in self.blocks

    def put_pulled(self, digest: bytes, block: CachedBlock, data: bytes | memoryview, now_ns: int) -> bool:
        """Store a block pulled from a peer after checking it byte for byte; announced in its tier."""
        if bytes(data) != block_payload(digest, self.block_bytes):
            self.counters.load_failures += 1
            return False
        return self.save(digest, block, now_ns, announce=True)

    def load(self, digests: Sequence[bytes], now_ns: int) -> tuple[int, int]:
        """Read and verify the leading run of `digests` for the GPU pool; (blocks loaded, of which from disk).
        A block that is missing or fails verification ends the run (it is dropped: the engine recomputes from
        there). Loaded blocks stop being announced in their tier (the pool announces them)."""
        now_ns = self._now(now_ns)
        n = from_disk = 0
        for d in digests:
            entry = self.blocks.get(d)
            if entry is None:
                break
            medium = entry[0]
            tier = self.cpu if medium == MEDIUM_CPU else self.disk
            data = tier.get(d, now_ns) if tier is not None else None
            if data is None or bytes(data) != block_payload(d, self.block_bytes):
                self.counters.load_failures += 1
                self.drop(d)
                break
            n += 1
            from_disk += medium == MEDIUM_DISK
            self._withdraw(d)
        self.counters.loaded_blocks += n
        self._collect_evictions(now_ns)
        return n, from_disk

    def drop(self, digest: bytes) -> None:
        """Forget a block (corrupt or unwanted)."""
        entry = self.blocks.pop(digest, None)
        if entry is None:
            return
        medium, _ = entry
        tier = self.cpu if medium == MEDIUM_CPU else self.disk
        if tier is not None:
            tier.evict(digest)
        self._withdraw(digest, medium=medium, block=entry[1])

    def drain_events(self) -> list[KvEvent]:
        ev, self._events = self._events, []
        return ev

    def dump(self) -> list[BlockStored]:
        """Every announced tier block as its own `BlockStored` (parents first)."""
        items = sorted((self.blocks[d] for d in self.announced), key=lambda mb: mb[1].depth)
        return [self._as_stored(medium, block) for medium, block in items]

    def close(self) -> None:
        if self.cpu is not None:
            self.cpu.close(unlink=True)
        if self.disk is not None:
            self.disk.close(unlink=True)

    # -- internals -------------------------------------------------------------------------------
    def _now(self, now_ns: int) -> int:
        return self.lease_clock_ns() if self.lease_clock_ns is not None else now_ns

    def _withdraw(self, digest: bytes, medium: str | None = None, block: CachedBlock | None = None) -> None:
        if digest not in self.announced:
            return
        self.announced.discard(digest)
        if medium is None or block is None:
            medium, block = self.blocks[digest]
        self._events.append(BlockRemoved(block_hashes=(block.block_hash,), medium=medium))

    def _collect_evictions(self, now_ns: int) -> None:
        """Turn the tiers' evictions into events; the CPU tier's victims are demoted to disk."""
        for _ in range(4):  # a demotion evicts from disk at most once more; bounded
            drained = [(d, MEDIUM_CPU) for d in self.cpu.drain_evicted()] if self.cpu is not None else []
            drained += [(d, MEDIUM_DISK) for d in self.disk.drain_evicted()] if self.disk is not None else []
            if not drained:
                return
            for d, medium in drained:
                self._evicted(d, medium, now_ns)

    def _evicted(self, digest: bytes, medium: str, now_ns: int) -> None:
        entry = self.blocks.get(digest)
        if entry is None or entry[0] != medium:
            return
        block = entry[1]
        announced = digest in self.announced
        self._withdraw(digest)
        del self.blocks[digest]
        demote = medium == MEDIUM_CPU and self.disk is not None
        if demote and self.disk.put(digest, block_payload(digest, self.block_bytes), now_ns):  # type: ignore[union-attr]
            self.blocks[digest] = (MEDIUM_DISK, block)
            self.counters.demoted += 1
            if announced:
                self.announced.add(digest)
                self._events.append(self._as_stored(MEDIUM_DISK, block))

    @staticmethod
    def _as_stored(medium: str, block: CachedBlock) -> BlockStored:
        return BlockStored(
            block_hashes=(block.block_hash,),
            parent_block_hash=block.parent_hash,
            token_ids=block.token_ids,
            block_size=len(block.token_ids),
            lora_name=block.lora_name,
            medium=medium,
            tenant=block.tenant,
        )
