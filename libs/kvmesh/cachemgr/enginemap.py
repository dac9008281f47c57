"""Per-worker map from engine block hashes to index block hashes.

`BlockRemoved` carries only engine hashes, and `BlockStored.parent_block_hash` is an engine hash, so
ingestion keeps, per worker, `engine hash → index hash`. An engine may hold the same hash in several
physical blocks (vLLM emits one `BlockStored` per copy and one `BlockRemoved` per evicted copy), so each
live entry carries a multiplicity: the index entry goes away when the multiplicity reaches 0.
Removed entries stay in a bounded FIFO of tombstones so that a later child whose parent was just evicted
can still be chained (the index hash is a pure function of content, so a stale mapping is still right).
"""

from __future__ import annotations

import numpy as np


class EngineHashMap:
    """engine hash → index hash for one worker; multiplicity > 1 kept in a side table (rare)."""

    __slots__ = ("extra", "live", "tomb", "tomb_capacity")

    def __init__(self, tomb_capacity: int = 65_536) -> None:
        self.live: dict[int, int] = {}
        self.extra: dict[int, int] = {}
        self.tomb: dict[int, int] = {}
        self.tomb_capacity = tomb_capacity

    def __len__(self) -> int:
        return len(self.live)

    def parent(self, engine_hash: int) -> int | None:
        """Index hash of `engine_hash` if it is live or recently removed, else None."""
        ih = self.live.get(engine_hash)
        return ih if ih is not None else self.tomb.get(engine_hash)

    def add(self, engine_hash: int, index_hash: int, count: bool = True) -> bool | None:
        """One more copy (`count=False`: set semantics, as in a dump).

        True: newly live (the index must store it); False: already live; None: conflicting index hash.
        """
        cur = self.live.get(engine_hash)
        if cur is None:
            self.live[engine_hash] = index_hash
            self.tomb.pop(engine_hash, None)
            return True
        if cur != index_hash:
            return None
        if count:
            self.extra[engine_hash] = self.extra.get(engine_hash, 1) + 1
        return False

    def drop(self, engine_hash: int, all_copies: bool = False) -> int | None:
        """One copy less (`all_copies`: every copy); the index hash when the last copy went, else None."""
        n = None if all_copies else self.extra.get(engine_hash)
        if all_copies:
            self.extra.pop(engine_hash, None)
        if n is not None:
            if n <= 2:
                del self.extra[engine_hash]
            else:
                self.extra[engine_hash] = n - 1
            return None
        ih = self.live.pop(engine_hash, None)
        if ih is not None:
            self.tomb[engine_hash] = ih
            if len(self.tomb) > self.tomb_capacity:
                del self.tomb[next(iter(self.tomb))]
        return ih

    def clear(self) -> None:
        """Forget every entry (tombstones too: after a clear nothing can chain on old blocks)."""
        self.live.clear()
        self.extra.clear()
        self.tomb.clear()

    def export(self) -> dict[str, bytes]:
        """Compact form: parallel uint64 arrays (engine, index, count) plus tombstones."""
        keys = np.fromiter(self.live.keys(), dtype=np.uint64, count=len(self.live))
        vals = np.fromiter(self.live.values(), dtype=np.uint64, count=len(self.live))
        ek = np.fromiter(self.extra.keys(), dtype=np.uint64, count=len(self.extra))
        ev = np.fromiter(self.extra.values(), dtype=np.uint64, count=len(self.extra))
        tk = np.fromiter(self.tomb.keys(), dtype=np.uint64, count=len(self.tomb))
        tv = np.fromiter(self.tomb.values(), dtype=np.uint64, count=len(self.tomb))
        return {n: a.tobytes() for n, a in (("lk", keys), ("lv", vals), ("ek", ek), ("ev", ev), ("tk", tk), ("tv", tv))}

    @classmethod
    def restore(cls, data: dict[str, bytes], tomb_capacity: int = 65_536) -> EngineHashMap:
        """Inverse of `export`."""
        m = cls(tomb_capacity)

        def arr(name: str) -> list[int]:
            return np.frombuffer(data[name], dtype=np.uint64).tolist()  # type: ignore[no-any-return]

        m.live = dict(zip(arr("lk"), arr("lv"), strict=True))
        m.extra = dict(zip(arr("ek"), arr("ev"), strict=True))
        m.tomb = dict(zip(arr("tk"), arr("tv"), strict=True))
        return m
