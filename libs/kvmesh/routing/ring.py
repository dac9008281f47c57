"""Consistent-hash ring with virtual nodes, for session affinity.

Each worker w owns `vnodes` points `xxh64("w#i")`, i < vnodes, on a 64-bit ring. A key k maps to the
owner of the first point clockwise from `xxh64(k)`. Adding or removing one of N workers moves only the keys
whose first point changes: about 1/N of them (standard deviation shrinking as 1/sqrt(vnodes)).
`lookup(key, allowed)` walks clockwise past points whose owner is not allowed (filtered out right now),
so a session falls back to its *next* ring owner and returns home once the owner is allowed again.
"""

from __future__ import annotations

import bisect
from collections.abc import Container, Iterable

import xxhash


def _h(s: str) -> int:
    return xxhash.xxh64_intdigest(s.encode())


class HashRing:
    """hash ring: owner(k) = owner of min{p ∈ points : p ≥ h(k)} (wrapping to the first point)."""

    def __init__(self, workers: Iterable[str] = (), vnodes: int = 128) -> None:
        if vnodes < 1:
            raise ValueError("vnodes must be >= 1")
        self.vnodes = vnodes
        self._points: list[int] = []
        self._owners: list[str] = []
        self._members: set[str] = set()
        for w in workers:
            self.add(w)

    @property
    def members(self) -> frozenset[str]:
        return frozenset(self._members)

    def __len__(self) -> int:
        return len(self._members)

    def add(self, worker: str) -> None:
        """Insert the worker's virtual nodes (no-op if present)."""
        if worker in self._members:
            return
        self._members.add(worker)
        for i in range(self.vnodes):
            p = _h(f"{worker}#{i}")
            j = bisect.bisect_left(self._points, p)
            self._points.insert(j, p)
            self._owners.insert(j, worker)

    def remove(self, worker: str) -> None:
        """Delete the worker's virtual nodes (no-op if absent)."""
        if worker not in self._members:
            return
        self._members.discard(worker)
        keep = [(p, o) for p, o in zip(self._points, self._owners, strict=True) if o != worker]
        self._points = [p for p, _ in keep]
        self._owners = [o for _, o in keep]

    def sync(self, workers: Iterable[str]) -> None:
        """Make the membership equal to `workers` (adds and removes the difference)."""
        want = set(workers)
        for w in self._members - want:
            self.remove(w)
        for w in want - self._members:
            self.add(w)

    def lookup(self, key: str, allowed: Container[str] | None = None) -> str | None:
        """The first owner clockwise from h(key) in `allowed` (any, if None); None if no such owner."""
        n = len(self._points)
        if n == 0:
            return None
        j = bisect.bisect_left(self._points, _h(key))
        owners = self._owners
        if allowed is None:
            return owners[j % n]
        for step in range(n):
            o = owners[(j + step) % n]
            if o in allowed:
                return o
        return None
