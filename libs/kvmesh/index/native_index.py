"""The prefix index on the compiled core ``kvmesh.index._native`` (same API and snapshots as the numpy one).

Semantics (radix tree over chained block hashes, see :mod:`kvmesh.index.prefix_index`):
``match(w) = max { m : w holds h_0, ..., h_{m-1} }``. The core is an open-addressing table
``block hash -> holders`` (16-byte slots, load <= 5/8; 1-4 holders inline as uint16 worker slots, more as a
``ceil(W / 64)``-word bitmask in a spill pool), so memory per distinct block is ``16 / load`` bytes plus
``8 * ceil(W / 64)`` only for blocks held by >= 4 workers. ``find_matches`` walks the query once,
intersecting the alive worker set with each block's holders, and stops when none is left.
``clear`` scans the table (O(capacity)): no per-worker block lists are kept. Worker names live here; the
core sees slot numbers and shares the ``_names`` list to build the result dict.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence

import numpy as np
import numpy.typing as npt

from kvmesh.index import _native, _snapshot

__all__ = ["NativePrefixIndex"]

U64Array = npt.NDArray[np.uint64]
HashesLike = Sequence[int] | npt.NDArray[np.integer]


def _arg(hashes: HashesLike) -> HashesLike:
    """numpy arrays go to the core as uint64 (buffer protocol); lists/tuples as they are."""
    if isinstance(hashes, np.ndarray) and hashes.dtype != np.uint64:
        return hashes.astype(np.uint64)
    return hashes


class NativePrefixIndex:
    """Block-hash -> workers index with radix-tree match semantics, on the C core."""

    def __init__(self, capacity: int = 1024, shared: str | None = None) -> None:
        self._names: list[str | None] = []  # shared with the core: mutate in place only
        self._slot_of: dict[str, int] = {}
        self._free_slots: list[int] = []
        self._core = _native.Index(self._names, max(16, capacity), shared)

    # ------------------------------------------------------------------ workers
    def _slot(self, worker: str) -> int:
        slot = self._slot_of.get(worker)
        if slot is not None:
            return slot
        if self._free_slots:
            slot = self._free_slots.pop()
            self._names[slot] = worker
        else:
            slot = len(self._names)
            if slot >= _native.MAX_WORKERS:
                raise ValueError(f"at most {_native.MAX_WORKERS} worker slots")
            self._names.append(worker)
        self._slot_of[worker] = slot
        return slot

    def workers(self) -> list[str]:
        return list(self._slot_of)

    # ------------------------------------------------------------------ mutations
    def store(self, worker: str, parent: int | None, hashes: HashesLike) -> None:
        """Record that ``worker`` holds ``hashes`` (``parent`` unused: hashes are chained)."""
        del parent
        w = self._slot_of.get(worker)
        self._core.store(self._slot(worker) if w is None else w, _arg(hashes))

    def remove(self, worker: str, hashes: HashesLike) -> None:
        """Forget that ``worker`` holds ``hashes`` (unknown worker / blocks are ignored)."""
        w = self._slot_of.get(worker)
        if w is not None:
            self._core.remove(w, _arg(hashes))

    def clear(self, worker: str) -> None:
        """Forget every block of ``worker`` (the worker stays known)."""
        w = self._slot_of.get(worker)
        if w is not None:
            self._core.clear(w)

    def remove_worker(self, worker: str) -> None:
        """Forget ``worker`` entirely; its slot is reused by the next new worker."""
        w = self._slot_of.pop(worker, None)
        if w is None:
            return
        self._core.clear(w)
        self._names[w] = None
        self._free_slots.append(w)

    # ------------------------------------------------------------------ queries
    def find_matches(self, hashes: HashesLike) -> dict[str, int]:
        """worker -> number of contiguous leading blocks of ``hashes`` it holds (workers with >= 1 only)."""
        if not self._slot_of:
            return {}
        result: dict[str, int] = self._core.find_matches(_arg(hashes))
        return result

    def first_held(self, worker: str, hashes: HashesLike) -> int:
        """The first position of ``hashes`` whose block ``worker`` holds (``len(hashes)`` if none)."""
        w = self._slot_of.get(worker)
        return len(hashes) if w is None else int(self._core.first_held(w, _arg(hashes)))

    def num_blocks(self, worker: str) -> int:
        w = self._slot_of.get(worker)
        return 0 if w is None else int(self._core.num_blocks(w))

    def num_pairs(self) -> int:
        return int(self._core.stats()[2])

    def num_entries(self) -> int:
        return int(self._core.stats()[1])

    def blocks_of(self, worker: str) -> U64Array:
        w = self._slot_of.get(worker)
        if w is None:
            return np.empty(0, dtype=np.uint64)
        return np.frombuffer(self._core.blocks_of(w), dtype=np.uint64)

    def iter_pairs(self) -> Iterator[tuple[str, int]]:
        """Every (worker, block hash) pair, worker by worker (for dumps and tests)."""
        for worker in list(self._slot_of):
            for h in self.blocks_of(worker).tolist():
                yield worker, h

    def nbytes(self) -> int:
        """Exact allocated size of the core's arrays (table, spill pool, free list, per-worker counts)."""
        return int(self._core.nbytes())

    def stats(self) -> dict[str, float]:
        cap, entries, pairs, spilled, nwords = self._core.stats()
        size = self.nbytes()
        return {
            "workers": float(len(self._slot_of)),
            "blocks": float(entries),
            "pairs": float(pairs),
            "bytes": float(size),
            "bytes_per_pair": size / pairs if pairs else 0.0,
            "table_capacity": float(cap),
            "table_load": entries / cap,
            "mask_words": float(nwords),
            "spilled_blocks": float(spilled),
        }

    # ------------------------------------------------------------------ snapshots
    def snapshot(self) -> bytes:
        """The format of :mod:`kvmesh.index._snapshot` (readable by either implementation)."""
        nwords = max(1, (len(self._names) + 63) // 64)
        keys, masks = self._core.export(nwords)
        return _snapshot.encode(list(self._names), nwords, keys, masks)

    @classmethod
    def restore(cls, data: bytes) -> NativePrefixIndex:
        names, nwords, keys, masks = _snapshot.decode(data)
        idx = cls(capacity=len(keys) // 8)
        idx._names.extend(names)
        idx._slot_of = {name: i for i, name in enumerate(names) if name is not None}
        idx._free_slots = [i for i, name in enumerate(names) if name is None][::-1]
        idx._core.load(keys, masks, nwords)
        return idx
