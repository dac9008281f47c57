"""Paged KV block pool with prefix caching and LRU eviction (pure, vLLM v1 semantics).

Blocks are numbered 0..N-1. A block is *referenced* while a running request holds it (ref > 0). A full
block of a request is *cached* under its chained hash; when its last reference goes it stays cached but
becomes *evictable*. Unreferenced blocks sit in one queue: blocks that hold nothing at the front, cached
blocks appended at the back in release order (a request releases its blocks tail-first so a chain is
evicted from its end). Allocation pops from the front; popping a cached block evicts it (`BlockRemoved`).
Every change of the cached set is recorded as an event, in order: the event log replays to exactly
`cached_hashes()`. Events carry `medium` (the core passes "GPU"). With `keep_evicted`, every evicted block's
description is kept until `take_evicted()` (the engine saves it to its host tiers).
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass

from kvmesh.core.kvevents import AllBlocksCleared, BlockRemoved, BlockStored, KvEvent


@dataclass(slots=True)
class _Block:
    ref: int = 0
    block_hash: int | None = None
    parent_hash: int | None = None
    token_ids: tuple[int, ...] = ()
    depth: int = 0  # position of the block in its chain (0 = first block of a prompt)
    lora_name: str | None = None
    tenant: str | None = None  # cache salt of the chain (events carry it; the index salts with it)
    digest: bytes | None = None  # collision-resistant identity (kept when the engine has host tiers)


@dataclass(frozen=True, slots=True)
class CachedBlock:
    """What the KV events of a cached block describe (an evicted block keeps it on its way to a tier)."""

    block_hash: int
    parent_hash: int | None
    token_ids: tuple[int, ...]
    depth: int
    lora_name: str | None = None
    tenant: str | None = None
    digest: bytes | None = None


class BlockPool:
    """The pool. Counts: `num_free` unreferenced (allocatable), `num_used` referenced, `num_cached`."""

    def __init__(self, num_blocks: int, block_size: int, medium: str | None = None, keep_evicted: bool = False) -> None:
        if num_blocks < 1 or block_size < 1:
            raise ValueError("num_blocks and block_size must be >= 1")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self._blocks = [_Block() for _ in range(num_blocks)]
        self._cached: dict[int, int] = {}  # hash -> block id
        self._free: OrderedDict[int, None] = OrderedDict((i, None) for i in range(num_blocks))
        self._events: list[KvEvent] = []
        self.evictions = 0
        self.medium = medium
        self.keep_evicted = keep_evicted
        self._evicted: list[CachedBlock] = []

    # -- queries ---------------------------------------------------------------------------------
    @property
    def num_free(self) -> int:
        return len(self._free)

    @property
    def num_used(self) -> int:
        return self.num_blocks - len(self._free)

    @property
    def num_cached(self) -> int:
        return len(self._cached)

    def usage(self) -> float:
        """Referenced fraction num_used / num_blocks (evictable cached blocks count as free)."""
        return self.num_used / self.num_blocks

    def cached_hashes(self) -> set[int]:
        return set(self._cached)

    def ref_count(self, block_id: int) -> int:
        return self._blocks[block_id].ref

    def match_prefix(self, hashes: Sequence[int]) -> list[int]:
        """Block ids of the longest leading run of `hashes` that is cached (O(k) for a match of k)."""
        out: list[int] = []
        for h in hashes:
            bid = self._cached.get(h)
            if bid is None:
                break
            out.append(bid)
        return out

    def block_tokens(self, block_hash: int) -> tuple[int | None, tuple[int, ...]] | None:
        """(parent hash, token ids) of a cached block, or None."""
        bid = self._cached.get(block_hash)
        if bid is None:
            return None
        b = self._blocks[bid]
        return b.parent_hash, b.token_ids

    # -- mutations -------------------------------------------------------------------------------
    def touch(self, block_ids: Sequence[int]) -> None:
        """Take a reference on each block (a prefix hit); an unreferenced block leaves the free queue."""
        for bid in block_ids:
            b = self._blocks[bid]
            if b.ref == 0:
                del self._free[bid]
            b.ref += 1

    def allocate(self, n: int) -> list[int]:
        """n blocks from the front of the free queue, each with ref 1; evicts cached ones popped."""
        if n > len(self._free):
            raise MemoryError(f"need {n} blocks, {len(self._free)} free")
        out: list[int] = []
        removed: list[int] = []
        for _ in range(n):
            bid, _ = self._free.popitem(last=False)
            b = self._blocks[bid]
            if b.block_hash is not None:
                del self._cached[b.block_hash]
                removed.append(b.block_hash)
                self.evictions += 1
                if self.keep_evicted:
                    self._evicted.append(
                        CachedBlock(b.block_hash, b.parent_hash, b.token_ids, b.depth, b.lora_name, b.tenant, b.digest)
                    )
                b.block_hash, b.parent_hash, b.token_ids, b.depth, b.tenant, b.lora_name = None, None, (), 0, None, None
                b.digest = None
            b.ref = 1
            out.append(bid)
        if removed:
            self._events.append(BlockRemoved(block_hashes=tuple(removed), medium=self.medium))
        return out

    def cache_full_blocks(
        self,
        block_ids: Sequence[int],
        hashes: Sequence[int],
        token_ids: Sequence[int],
        first_depth: int,
        parent_hash: int | None,
        lora_name: str | None = None,
        tenant: str | None = None,
        digests: Sequence[bytes] | None = None,
    ) -> None:
        """Register newly filled blocks (chain order) under their hashes and emit one `BlockStored`.

        `token_ids` holds len(block_ids)·block_size ids; `tenant` (the chain's cache salt) rides on the events;
        `digests` (optional) are the blocks' collision-resistant identities, kept for their eviction.
        A hash already cached elsewhere (a concurrent request computed the same block) leaves this copy
        uncached, as vLLM does.
        """
        bs = self.block_size
        stored_hashes: list[int] = []
        stored_tokens: list[int] = []
        run_parent = parent_hash
        for i, (bid, h) in enumerate(zip(block_ids, hashes, strict=True)):
            toks = tuple(token_ids[i * bs : (i + 1) * bs])
            parent = parent_hash if i == 0 else hashes[i - 1]
            if h in self._cached:
                self._flush_stored(stored_hashes, stored_tokens, run_parent, lora_name, tenant)
                stored_hashes, stored_tokens, run_parent = [], [], h
                continue
            b = self._blocks[bid]
            b.block_hash, b.parent_hash, b.token_ids, b.depth, b.tenant = h, parent, toks, first_depth + i, tenant
            b.lora_name = lora_name
            b.digest = digests[i] if digests is not None else None
            self._cached[h] = bid
            stored_hashes.append(h)
            stored_tokens.extend(toks)
        self._flush_stored(stored_hashes, stored_tokens, run_parent, lora_name, tenant)

    def _flush_stored(
        self, hashes: list[int], tokens: list[int], parent: int | None, lora_name: str | None, tenant: str | None
    ) -> None:
        if hashes:
            self._events.append(
                BlockStored(
                    block_hashes=tuple(hashes),
                    parent_block_hash=parent,
                    token_ids=tuple(tokens),
                    block_size=self.block_size,
                    lora_name=lora_name,
                    medium=self.medium,
                    tenant=tenant,
                )
            )

    def release(self, block_ids: Sequence[int]) -> None:
        """Drop one reference from each block, tail-first; a block reaching 0 joins the free queue
        (front if it holds nothing, back if cached, i.e. most recently used)."""
        for bid in reversed(block_ids):
            b = self._blocks[bid]
            if b.ref <= 0:
                raise ValueError(f"block {bid} released twice")
            b.ref -= 1
            if b.ref == 0:
                self._free[bid] = None
                if b.block_hash is None:
                    self._free.move_to_end(bid, last=False)

    def insert_cached(self, block_hash: int, parent_hash: int | None, token_ids: Sequence[int], depth: int) -> bool:
        """Store an imported block as cached and evictable (most recently used). False if present or full."""
        if block_hash in self._cached or not self._free:
            return False
        (bid,) = self.allocate(1)
        self.cache_full_blocks([bid], [block_hash], token_ids, depth, parent_hash)
        self.release([bid])
        return True

    def reset_prefix_cache(self) -> bool:
        """Forget every cached block (only when none is referenced); emits `AllBlocksCleared`."""
        if self.num_used:
            return False
        for b in self._blocks:
            b.block_hash, b.parent_hash, b.token_ids, b.depth, b.tenant, b.lora_name = None, None, (), 0, None, None
            b.digest = None
        self._cached.clear()
        self._events.append(AllBlocksCleared())
        return True

    def drain_events(self) -> list[KvEvent]:
        ev, self._events = self._events, []
        return ev

    def emit(self, events: Sequence[KvEvent]) -> None:
        """Append events of the engine's other media, in order with the pool's own."""
        self._events.extend(events)

    def take_evicted(self) -> list[CachedBlock]:
        """Blocks evicted since the last call, in eviction order (with `keep_evicted`)."""
        out, self._evicted = self._evicted, []
        return out

    def dump(self) -> list[BlockStored]:
        """Every cached block as its own `BlockStored`, ordered by chain depth (parents first)."""
        items = sorted(self._cached.items(), key=lambda kv: self._blocks[kv[1]].depth)
        return [
            BlockStored(
                block_hashes=(h,),
                parent_block_hash=self._blocks[bid].parent_hash,
                token_ids=self._blocks[bid].token_ids,
                block_size=self.block_size,
                lora_name=self._blocks[bid].lora_name,
                medium=self.medium,
                tenant=self._blocks[bid].tenant,
            )
            for h, bid in items
        ]
