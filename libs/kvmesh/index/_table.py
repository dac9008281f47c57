"""A vectorised open-addressing hash table: uint64 key -> int32 entry id (pure numpy).

Layout: ``keys[cap]`` (uint64) and ``ents[cap]`` (int32; ``EMPTY`` = -1, ``TOMB`` = -2) with ``cap`` a power
of two. Home slot of key ``h`` is Fibonacci hashing ``(h * 0x9E3779B97F4A7C15 mod 2^64) >> (64 - log2 cap)``
(so clustered keys spread out); collisions probe linearly within the ``WINDOW`` slots from home (arrays
are padded: no wrap-around). A key that finds no free slot there lives in a small overflow dict (rare at
load <= 0.5). So a lookup of ``k`` keys is two vectorised rounds (home slot, then the window of the keys
left): O(k) element work and O(1) numpy calls. The load (live + tombstones) is kept below ``MAX_LOAD``;
past it the table is rebuilt (doubled when live keys alone exceed ``MAX_LOAD / 2``).
"""

from __future__ import annotations

import numpy as np
import numpy.typing as npt
from numpy.lib.stride_tricks import sliding_window_view

EMPTY = -1
TOMB = -2
OVERFLOW = -3
MAX_LOAD = 0.5
WINDOW = 8  # probe range (home + 7); _first_true needs exactly 8
_ONE = np.uint64(1)
_GOLD = np.uint64(0x9E3779B97F4A7C15)

I64Array = npt.NDArray[np.int64]
U64Array = npt.NDArray[np.uint64]


def _first_true(rows: npt.NDArray[np.bool_]) -> tuple[npt.NDArray[np.bool_], I64Array]:
    """(any, index of the first True) per row of a (k, 8) bool array, via its uint64 view (no axis reductions).

    The first True byte of little-endian word ``x`` is ``popcount((x & -x) - 1) // 8``.
    """
    x = np.ascontiguousarray(rows).view(np.uint64).reshape(-1)
    low = x & (~x + _ONE)
    low -= _ONE
    return x != 0, (np.bitwise_count(low) >> 3).astype(np.int64)


class U64Table:
    """uint64 key -> entry id map with batched lookup / insert / delete."""

    __slots__ = ("_bits", "_ewin", "_kwin", "_shift", "cap", "ents", "keys", "live", "overflow", "used")

    def __init__(self, cap: int = 1024) -> None:
        bits = max(4, (cap - 1).bit_length())
        self._alloc(bits)

    def _alloc(self, bits: int) -> None:
        self._bits = bits
        self.cap = 1 << bits
        self._shift = np.uint64(64 - bits)
        # WINDOW - 1 padding slots at the end: probe ranges never wrap around
        self.keys: U64Array = np.zeros(self.cap + WINDOW - 1, dtype=np.uint64)
        self.ents: npt.NDArray[np.int32] = np.full(self.cap + WINDOW - 1, EMPTY, dtype=np.int32)
        self._kwin = sliding_window_view(self.keys, WINDOW)
        self._ewin = sliding_window_view(self.ents, WINDOW)
        self.live = 0
        self.used = 0
        self.overflow: dict[int, int] = {}

    def nbytes(self) -> int:
        return int(self.keys.nbytes + self.ents.nbytes)

    def _home(self, hs: U64Array) -> I64Array:
        return ((hs * _GOLD) >> self._shift).view(np.int64)

    def lookup(self, hs: U64Array) -> tuple[I64Array, I64Array]:
        """(entry id or -1, slot or -1; ``OVERFLOW`` for keys kept in the overflow dict) for every key.

        Round 1 probes the home slot of every key; round 2 reads the whole ``WINDOW``-slot probe range of the
        keys left at once ((k, WINDOW) row gathers from a sliding-window view). A key is never placed
        outside its range (else it goes to the overflow dict), so a key not found in its range is absent
        unless the range has no EMPTY slot.
        """
        slots = self._home(hs)
        ents = self.ents
        e = ents[slots].astype(np.int64)
        hit = (self.keys[slots] == hs) & (e >= 0)
        if hit.all():
            return e, slots
        miss = ~hit
        rest = np.flatnonzero(miss & (e != EMPTY))
        e[miss] = -1
        slots = np.where(miss, -1, slots)
        if rest.shape[0] == 0:
            return e, slots
        home = self._home(hs[rest])
        wents = self._ewin[home]
        match = (self._kwin[home] == hs[rest, None]) & (wents >= 0)
        found, pos = _first_true(match)
        fr = rest[found]
        fs = home[found] + pos[found]
        e[fr] = ents[fs]
        slots[fr] = fs
        if self.overflow:
            has_empty, _ = _first_true(wents == EMPTY)
            unsure = rest[~found & ~has_empty]
            get = self.overflow.get
            for i, h in zip(unsure.tolist(), hs[unsure].tolist(), strict=True):
                eid = get(h)
                if eid is not None:
                    e[i] = eid
                    slots[i] = OVERFLOW
        return e, slots

    def insert_new(self, hs: U64Array, eids: I64Array) -> None:
        """Insert keys known to be absent and pairwise distinct.

        Each round gives every pending key the first free (EMPTY or TOMB) slot of its probe range; among
        keys racing for one slot the lowest index wins, the others retry. Tombstones may be reused because
        the caller has checked that the key is absent. A key whose whole range is occupied goes to the
        overflow dict.
        """
        if self.used + hs.shape[0] > MAX_LOAD * self.cap:
            self._rebuild(self.live + hs.shape[0])
        home = self._home(hs)
        todo = np.arange(hs.shape[0])
        ents = self.ents
        for _ in range(hs.shape[0] + 1):
            has, pos = _first_true(self._ewin[home[todo]] < 0)
            if not has.all():
                for i in todo[~has].tolist():
                    self.overflow[int(hs[i])] = int(eids[i])
                self.live += int(np.count_nonzero(~has))
                todo, pos = todo[has], pos[has]
            if todo.shape[0] == 0:
                break
            cand = home[todo] + pos
            if cand.shape[0] > 1:
                cand, first = np.unique(cand, return_index=True)
                win_keys = todo[first]
            else:
                win_keys = todo
            self.used += int(np.count_nonzero(ents[cand] == EMPTY))
            self.keys[cand] = hs[win_keys]
            ents[cand] = eids[win_keys]
            self.live += cand.shape[0]
            if win_keys.shape[0] == todo.shape[0]:
                break
            done = np.zeros(hs.shape[0], dtype=bool)
            done[win_keys] = True
            todo = todo[~done[todo]]

    def delete(self, slots: I64Array, hs: U64Array) -> None:
        """Delete the (live, distinct) keys ``hs`` found at ``slots`` (tombstones; overflow keys popped)."""
        ov = slots == OVERFLOW
        if ov.any():
            for h in hs[ov].tolist():
                del self.overflow[h]
            slots = slots[~ov]
        self.ents[slots] = TOMB
        self.live -= hs.shape[0]

    def live_items(self) -> tuple[U64Array, I64Array]:
        idx = np.flatnonzero(self.ents >= 0)  # (padding slots included: ranges reach into them)
        keys, ents = self.keys[idx], self.ents[idx].astype(np.int64)
        if self.overflow:
            keys = np.concatenate([keys, np.fromiter(self.overflow.keys(), np.uint64, len(self.overflow))])
            ents = np.concatenate([ents, np.fromiter(self.overflow.values(), np.int64, len(self.overflow))])
        return keys, ents

    def _rebuild(self, need: int) -> None:
        keys, ents = self.live_items()
        bits = self._bits
        while need > (MAX_LOAD / 2) * (1 << bits):
            bits += 1
        self._alloc(bits)
        if keys.shape[0]:
            self.insert_new(keys, ents)

    def maybe_compact(self) -> bool:
        """Rebuild when tombstones dominate (used > MAX_LOAD * cap with few live keys). Returns whether it did."""
        if self.used > MAX_LOAD * self.cap * 0.9 and self.live < self.used // 2:
            self._rebuild(self.live)
            return True
        return False
