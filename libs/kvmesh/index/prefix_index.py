"""The global KV prefix index, numpy reference implementation (the fallback when the C core is not built).

Representation. Block hashes are chained (``kvmesh.index.hashing``): a hash identifies its whole prefix, so a radix
tree over block chains is equivalent to a flat map ``block hash -> set of workers``, with a worker's match for
a query ``h_0..h_{k-1}`` defined exactly as a radix-tree walk would give it:

    match(w) = max { m : w holds h_0, ..., h_{m-1} }          (stops at w's first missing block)

Each distinct block is one *entry*: its key (uint64) and a worker bitmask of ``nwords = ceil(W / 64)`` uint64
words (``W`` = worker slots), found through a vectorised open-addressing table (:mod:`._table`). Memory is
``table (12 B / slot, load <= 0.5) + 8 B key + 8 * nwords B mask`` per distinct block, shared by every worker
holding it: see :meth:`PrefixIndex.nbytes` (exact: the sum of the numpy buffers' ``nbytes``).

``find_matches`` looks the query up in chunks of 64, 512, 4096, ... blocks; per chunk ``cum = AND-accumulate``
of the worker masks (intersected with the still-alive set) gives, at each change of ``cum``, the workers whose
match ends there. It stops after the first chunk in which no worker is left alive, so a query that misses at
block ``k`` costs O(k) element work and O(log k) numpy calls.

``parent`` in :meth:`store` is accepted for the radix-tree contract but not needed: chained hashes already
encode it.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence

import numpy as np
import numpy.typing as npt

from kvmesh.index import _snapshot
from kvmesh.index._table import U64Table

__all__ = ["NumpyPrefixIndex"]

U64Array = npt.NDArray[np.uint64]
I64Array = npt.NDArray[np.int64]
HashesLike = Sequence[int] | npt.NDArray[np.integer]

_FIRST_CHUNK = 64
_CHUNK_GROWTH = 8


def _as_u64(hashes: HashesLike) -> U64Array:
    if isinstance(hashes, np.ndarray):
        if hashes.dtype == np.uint64:
            return hashes  # type: ignore[return-value]
        return hashes.astype(np.uint64)
    return np.array(hashes, dtype=np.uint64)


class NumpyPrefixIndex:
    """Block-hash -> workers index with radix-tree match semantics (see the module docstring)."""

    def __init__(self, capacity: int = 1024) -> None:
        self._table = U64Table(2 * capacity)
        self._nwords = 1
        cap = max(16, capacity)
        self._ekey: U64Array = np.zeros(cap, dtype=np.uint64)
        self._mask: U64Array = np.zeros((cap, 1), dtype=np.uint64)
        self._nent = 1  # entry 0 is the permanent all-zero row that misses map to
        self._free: npt.NDArray[np.int64] = np.empty(0, dtype=np.int64)
        self._slot_of: dict[str, int] = {}
        self._names: list[str | None] = []
        self._free_slots: list[int] = []

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
            self._names.append(worker)
        self._slot_of[worker] = slot
        if slot >= 64 * self._nwords:
            grown = np.zeros((self._mask.shape[0], slot // 64 + 1), dtype=np.uint64)
            grown[:, : self._nwords] = self._mask
            self._mask = grown
            self._nwords = grown.shape[1]
        return slot

    def workers(self) -> list[str]:
        return list(self._slot_of)

    # ------------------------------------------------------------------ entries
    def _alloc(self, k: int) -> I64Array:
        take = min(k, self._free.shape[0])
        ids = self._free[self._free.shape[0] - take :]
        self._free = self._free[: self._free.shape[0] - take]
        rest = k - take
        if rest:
            start = self._nent
            if start + rest > self._ekey.shape[0]:
                self._grow(start + rest)
            self._nent = start + rest
            ids = np.concatenate([ids, np.arange(start, start + rest, dtype=np.int64)])
        return ids

    def _grow(self, need: int) -> None:
        cap = max(need, self._ekey.shape[0] * 3 // 2)
        ekey = np.zeros(cap, dtype=np.uint64)
        ekey[: self._nent] = self._ekey[: self._nent]
        mask = np.zeros((cap, self._nwords), dtype=np.uint64)
        mask[: self._nent] = self._mask[: self._nent]
        self._ekey, self._mask = ekey, mask

    def _release(self, eids: I64Array, slots: I64Array) -> None:
        """Drop entries whose mask became all-zero (``eids``/``slots`` distinct)."""
        if eids.shape[0]:
            self._table.delete(slots, self._ekey[eids])
            self._free = np.concatenate([self._free, eids])
            self._table.maybe_compact()

    # ------------------------------------------------------------------ mutations
    def store(self, worker: str, parent: int | None, hashes: HashesLike) -> None:
        """Record that ``worker`` holds ``hashes`` (``parent`` unused: hashes are chained)."""
        del parent
        hs = _as_u64(hashes)
        w = self._slot(worker)
        if hs.shape[0] == 0:
            return
        e, _ = self._table.lookup(hs)
        miss = e < 0
        if miss.any():
            new = hs[miss]
            if new.shape[0] > 1:
                uniq, inv = np.unique(new, return_inverse=True)
            else:
                uniq, inv = new, np.zeros(1, dtype=np.int64)
            ids = self._alloc(uniq.shape[0])
            self._table.insert_new(uniq, ids)
            self._ekey[ids] = uniq
            e[miss] = ids[inv]
        word = w >> 6
        self._mask[e, word] |= np.uint64(1 << (w & 63))

    def remove(self, worker: str, hashes: HashesLike) -> None:
        """Forget that ``worker`` holds ``hashes`` (unknown worker / blocks are ignored)."""
        w = self._slot_of.get(worker)
        if w is None:
            return
        hs = _as_u64(hashes)
        if hs.shape[0] == 0:
            return
        e, slots = self._table.lookup(hs)
        ok = e >= 0
        e, slots = e[ok], slots[ok]
        if e.shape[0] == 0:
            return
        word = w >> 6
        self._mask[e, word] &= np.uint64(~(1 << (w & 63)) & 0xFFFFFFFFFFFFFFFF)
        dead = ~self._mask[e].any(axis=1)
        if dead.any():
            ed, sd = e[dead], slots[dead]
            if ed.shape[0] > 1:
                ed, first = np.unique(ed, return_index=True)
                sd = sd[first]
            self._release(ed, sd)

    def clear(self, worker: str) -> None:
        """Forget every block of ``worker`` (the worker stays known, e.g. after an engine cache reset)."""
        w = self._slot_of.get(worker)
        if w is None:
            return
        word, bit = w >> 6, np.uint64(1 << (w & 63))
        col = self._mask[: self._nent, word]
        idx = np.flatnonzero(col & bit)
        if idx.shape[0] == 0:
            return
        self._mask[idx, word] &= ~bit
        dead = idx[~self._mask[idx].any(axis=1)]
        if dead.shape[0]:
            _, slots = self._table.lookup(self._ekey[dead])
            self._release(dead.astype(np.int64), slots)

    def remove_worker(self, worker: str) -> None:
        """Forget ``worker`` entirely; its slot is reused by the next new worker."""
        if worker not in self._slot_of:
            return
        self.clear(worker)
        slot = self._slot_of.pop(worker)
        self._names[slot] = None
        self._free_slots.append(slot)

    # ------------------------------------------------------------------ queries
    def find_matches(self, hashes: HashesLike) -> dict[str, int]:
        """worker -> number of contiguous leading blocks of ``hashes`` it holds (workers with >= 1 only)."""
        hs = _as_u64(hashes)
        n = hs.shape[0]
        out: dict[str, int] = {}
        if n == 0 or not self._slot_of:
            return out
        names = self._names
        alive = np.full(self._nwords, 0xFFFFFFFFFFFFFFFF, dtype=np.uint64)
        lookup, mask = self._table.lookup, self._mask
        start, size = 0, _FIRST_CHUNK
        while start < n:
            stop = min(n, start + size)
            e, _ = lookup(hs[start:stop])
            np.maximum(e, 0, out=e)
            cum = np.bitwise_and.accumulate(mask[e], axis=0)
            cum &= alive
            changed = np.empty(cum.shape[0], dtype=bool)
            changed[0] = bool((cum[0] != alive).any())
            if cum.shape[0] > 1:
                np.any(cum[1:] != cum[:-1], axis=1, out=changed[1:])
            for i in np.flatnonzero(changed).tolist():
                pos = start + i
                if pos == 0:
                    continue  # workers dropping at block 0 match nothing
                prev = alive if i == 0 else cum[i - 1]
                for j, word in enumerate((prev & ~cum[i]).tolist()):
                    while word:
                        low = word & -word
                        name = names[j * 64 + low.bit_length() - 1]
                        if name is not None:
                            out[name] = pos
                        word ^= low
            alive = cum[-1]
            if not alive.any():
                return out
            start, size = stop, size * _CHUNK_GROWTH
        for j, word in enumerate(alive.tolist()):
            while word:
                low = word & -word
                name = names[j * 64 + low.bit_length() - 1]
                if name is not None:
                    out[name] = n
                word ^= low
        return out

    def num_blocks(self, worker: str) -> int:
        w = self._slot_of.get(worker)
        if w is None:
            return 0
        col = self._mask[: self._nent, w >> 6]
        return int(np.count_nonzero(col & np.uint64(1 << (w & 63))))

    def num_pairs(self) -> int:
        """Total (worker, block) pairs: popcount of every live mask."""
        return int(np.bitwise_count(self._mask[: self._nent]).sum())

    def num_entries(self) -> int:
        return self._table.live

    def blocks_of(self, worker: str) -> U64Array:
        w = self._slot_of.get(worker)
        if w is None:
            return np.empty(0, dtype=np.uint64)
        col = self._mask[: self._nent, w >> 6]
        return self._ekey[: self._nent][(col & np.uint64(1 << (w & 63))) != 0]

    def iter_pairs(self) -> Iterator[tuple[str, int]]:
        """Every (worker, block hash) pair, worker by worker (for dumps and tests)."""
        for worker in list(self._slot_of):
            for h in self.blocks_of(worker).tolist():
                yield worker, h

    def nbytes(self) -> int:
        """Exact size of the numpy buffers (the index's bulk; Python worker-name objects excluded)."""
        return int(self._table.nbytes() + self._ekey.nbytes + self._mask.nbytes + self._free.nbytes)

    def stats(self) -> dict[str, float]:
        pairs = self.num_pairs()
        size = self.nbytes()
        return {
            "workers": float(len(self._slot_of)),
            "blocks": float(self._table.live),
            "pairs": float(pairs),
            "bytes": float(size),
            "bytes_per_pair": size / pairs if pairs else 0.0,
            "table_capacity": float(self._table.cap),
            "table_load": self._table.used / self._table.cap,
            "mask_words": float(self._nwords),
        }

    # ------------------------------------------------------------------ snapshots
    def snapshot(self) -> bytes:
        """The format of :mod:`kvmesh.index._snapshot` (readable by either implementation)."""
        keys, ents = self._table.live_items()
        masks = np.ascontiguousarray(self._mask[ents.astype(np.int64)])
        return _snapshot.encode(list(self._names), self._nwords, keys.tobytes(), masks.tobytes())

    @classmethod
    def restore(cls, data: bytes) -> NumpyPrefixIndex:
        names, nwords, kbytes, mbytes = _snapshot.decode(data)
        keys = np.frombuffer(kbytes, dtype=np.uint64)
        n = keys.shape[0]
        masks = np.frombuffer(mbytes, dtype=np.uint64).reshape(n, nwords)
        idx = cls(capacity=max(16, n))
        idx._nwords = nwords
        idx._ekey = np.zeros(n + 16, dtype=np.uint64)
        idx._mask = np.zeros((n + 16, nwords), dtype=np.uint64)
        idx._ekey[1 : n + 1] = keys
        idx._mask[1 : n + 1] = masks
        idx._nent = n + 1
        idx._table.insert_new(keys, np.arange(1, n + 1, dtype=np.int64))
        idx._names = list(names)
        idx._slot_of = {name: i for i, name in enumerate(names) if name is not None}
        idx._free_slots = [i for i, name in enumerate(names) if name is None][::-1]
        return idx
