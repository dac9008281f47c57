"""A mirror of an engine's cached blocks, maintained from its KV events (pure).

Each block remembers its chain's tenant (cache salt): an event that does not carry one (vLLM puts the salt
only on the block that starts at token 0) inherits its parent's, so `with_chain_tenant` completes events
and `dump()` emits every block with its tenant.

A block is kept per medium (None reads as "GPU"): an engine may hold one block in its pool and in a host
tier at once (kvmesh's vLLM connector writes every computed block through to its CPU tier, announced under
the same hash), and removing one copy leaves the other. `AllBlocksCleared` (a reset of the engine's pool) drops the GPU
copies only.
"""

from __future__ import annotations

import dataclasses

from kvmesh.core.kvevents import MEDIUM_GPU, BlockRemoved, BlockStored, KvEvent, medium_of


class CacheMirror:
    """The engine's cached blocks as seen through its events (for `dump_blocks`)."""

    def __init__(self) -> None:
        # hash -> medium -> (depth, single-block event)
        self._blocks: dict[int, dict[str, tuple[int, BlockStored]]] = {}
        self._gpu = 0  # blocks with a copy in the engine's pool

    def __len__(self) -> int:
        """Blocks in the engine's own pool (GPU); host-tier copies are not counted."""
        return self._gpu

    def hashes(self) -> set[int]:
        """Hashes of the blocks held in any medium."""
        return set(self._blocks)

    def _entry(self, block_hash: int | None) -> tuple[int, BlockStored] | None:
        media = self._blocks.get(block_hash) if block_hash is not None else None
        return next(iter(media.values())) if media else None

    def tenant_of(self, block_hash: int | None) -> str | None:
        """Tenant of a mirrored block (None if unknown or untenanted)."""
        e = self._entry(block_hash)
        return e[1].tenant if e is not None else None

    def with_chain_tenant(self, ev: KvEvent) -> KvEvent:
        """`ev` with the parent's tenant filled in when it carries none (other events unchanged)."""
        if isinstance(ev, BlockStored) and ev.tenant is None and ev.parent_block_hash is not None:
            t = self.tenant_of(ev.parent_block_hash)
            if t is not None:
                return dataclasses.replace(ev, tenant=t)
        return ev

    def apply(self, ev: KvEvent) -> None:
        if isinstance(ev, BlockStored):
            self._stored(ev)
        elif isinstance(ev, BlockRemoved):
            medium = medium_of(ev.medium)
            for h in ev.block_hashes:
                media = self._blocks.get(h)
                if media is None or media.pop(medium, None) is None:
                    continue
                if medium == MEDIUM_GPU:
                    self._gpu -= 1
                if not media:
                    del self._blocks[h]
        else:  # AllBlocksCleared: the engine's pool was reset; host-tier copies stay
            for h in [h for h, media in self._blocks.items() if media.pop(MEDIUM_GPU, None) is not None and not media]:
                del self._blocks[h]
            self._gpu = 0

    def _stored(self, ev: BlockStored) -> None:
        parent, bs, medium = ev.parent_block_hash, ev.block_size, medium_of(ev.medium)
        pe = self._entry(parent)
        depth = pe[0] + 1 if pe is not None else 0
        tenant = ev.tenant if ev.tenant is not None else self.tenant_of(parent)
        for i, h in enumerate(ev.block_hashes):
            toks = ev.token_ids[i * bs : (i + 1) * bs]
            media = self._blocks.setdefault(h, {})
            if medium == MEDIUM_GPU and medium not in media:
                self._gpu += 1
            media[medium] = (depth, BlockStored((h,), parent, toks, bs, ev.lora_name, ev.medium, tenant))
            parent, depth = h, depth + 1

    def dump(self) -> list[BlockStored]:
        """Every copy as a single-block event, parents before children."""
        entries = [e for media in self._blocks.values() for e in media.values()]
        return [e for _, e in sorted(entries, key=lambda de: de[0])]
