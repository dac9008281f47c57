"""A mirror of an engine's cached blocks, maintained from its KV events (pure)."""

from __future__ import annotations

from kvmesh.kvevents import BlockRemoved, BlockStored, KvEvent


class CacheMirror:
    """The engine's cached blocks as seen through its events (for `dump_blocks`)."""

    def __init__(self) -> None:
        self._blocks: dict[int, tuple[int, BlockStored]] = {}  # hash -> (depth, single-block event)

    def __len__(self) -> int:
        return len(self._blocks)

    def hashes(self) -> set[int]:
        return set(self._blocks)

    def apply(self, ev: KvEvent) -> None:
        if isinstance(ev, BlockStored):
            parent = ev.parent_block_hash
            bs = ev.block_size
            depth = self._blocks[parent][0] + 1 if parent in self._blocks else 0
            for i, h in enumerate(ev.block_hashes):
                toks = ev.token_ids[i * bs : (i + 1) * bs]
                self._blocks[h] = (depth, BlockStored((h,), parent, toks, bs, ev.lora_name, ev.medium))
                parent, depth = h, depth + 1
        elif isinstance(ev, BlockRemoved):
            for h in ev.block_hashes:
                self._blocks.pop(h, None)
        else:
            self._blocks.clear()

    def dump(self) -> list[BlockStored]:
        return [e for _, e in sorted(self._blocks.values(), key=lambda de: de[0])]
