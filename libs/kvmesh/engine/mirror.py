"""A mirror of an engine's cached blocks, maintained from its KV events (pure).

Each block remembers its chain's tenant (cache salt): an event that does not carry one (vLLM puts the salt
only on the block that starts at token 0) inherits its parent's, so `with_chain_tenant` completes events
and `dump()` emits every block with its tenant.
"""

from __future__ import annotations

import dataclasses

from kvmesh.kvevents import BlockRemoved, BlockStored, KvEvent


class CacheMirror:
    """The engine's cached blocks as seen through its events (for `dump_blocks`)."""

    def __init__(self) -> None:
        self._blocks: dict[int, tuple[int, BlockStored]] = {}  # hash -> (depth, single-block event)

    def __len__(self) -> int:
        return len(self._blocks)

    def hashes(self) -> set[int]:
        return set(self._blocks)

    def tenant_of(self, block_hash: int | None) -> str | None:
        """Tenant of a mirrored block (None if unknown or untenanted)."""
        e = self._blocks.get(block_hash) if block_hash is not None else None
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
            parent = ev.parent_block_hash
            bs = ev.block_size
            depth = self._blocks[parent][0] + 1 if parent in self._blocks else 0
            tenant = ev.tenant if ev.tenant is not None else self.tenant_of(parent)
            for i, h in enumerate(ev.block_hashes):
                toks = ev.token_ids[i * bs : (i + 1) * bs]
                self._blocks[h] = (depth, BlockStored((h,), parent, toks, bs, ev.lora_name, ev.medium, tenant))
                parent, depth = h, depth + 1
        elif isinstance(ev, BlockRemoved):
            for h in ev.block_hashes:
                self._blocks.pop(h, None)
        else:
            self._blocks.clear()

    def dump(self) -> list[BlockStored]:
        return [e for _, e in sorted(self._blocks.values(), key=lambda de: de[0])]
