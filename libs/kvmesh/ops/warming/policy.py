"""Hybrid LFU+LRU policy: which prefixes stay warm under a capacity bound (pure; time is an argument).

Each warm prefix p has a score, the LRFU combination of frequency and recency (Lee et al., 2001):

    score_p(now) = Σ_i 2^(−(now − t_i) / h)        over the accesses t_i of p,

kept incrementally as `s ← s · 2^(−(t − t_last)/h) + 1` at each access. With half-life h → ∞ it is LFU
(a count), with h → 0 it is LRU (the most recent access wins). Prefixes are admitted while the sum of
their sizes (blocks) fits `capacity`; otherwise the lowest-scoring prefixes are evicted, but only if their
score is below the newcomer's (a cold newcomer does not push out a hot resident). Pinned prefixes (static
templates) are never evicted.

With an explicit frequency weight `lfu_weight` = w ∈ [0, 1] (operator-set, `SetWarmingPolicy`) the score is
instead the blend

    score_p(now) = w · n_p + (1 − w) · 2^(−(now − t_last,p) / h)

of the access count n_p (LFU: admission hits + touches, undecayed) and the recency of the last access
(LRU, in (0, 1]): w = 1 is pure LFU, w = 0 pure LRU, and in between a prefix needs ⌈(1 − w)/w⌉ more
accesses to outrank one accessed now. A newcomer is scored the same way (n = its hits, accessed now).
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(slots=True)
class Entry:
    """A warm prefix."""

    size: int
    score: float
    last: float
    pinned: bool = False
    count: float = 0.0


class HybridWarmSet:
    """The set of warm prefixes under `capacity` blocks (see module docstring)."""

    def __init__(self, capacity: int, half_life_s: float = 120.0, lfu_weight: float | None = None) -> None:
        if capacity <= 0 or half_life_s <= 0:
            raise ValueError("capacity and half_life_s must be positive")
        self.lfu_weight: float | None = None
        self.set_lfu_weight(lfu_weight)
        self.capacity = capacity
        self.half_life_s = half_life_s
        self.entries: dict[int, Entry] = {}
        self.used = 0

    def set_lfu_weight(self, w: float | None) -> None:
        """None: the LRFU score; w in [0, 1]: the LFU/LRU blend (see module docstring)."""
        if w is not None and not 0.0 <= w <= 1.0:
            raise ValueError("lfu_weight must be in [0, 1]")
        self.lfu_weight = w

    def _blend(self, count: float, last: float, now: float) -> float:
        w = self.lfu_weight
        assert w is not None
        return w * count + (1.0 - w) * 2.0 ** (-(now - last) / self.half_life_s)

    def score(self, key: int, now: float) -> float:
        """Current score (0 if not warm)."""
        e = self.entries.get(key)
        if e is None:
            return 0.0
        if self.lfu_weight is not None:
            return self._blend(e.count, e.last, now)
        return e.score * 2.0 ** (-(now - e.last) / self.half_life_s)

    def touch(self, key: int, now: float) -> None:
        """Record an access of a warm prefix."""
        e = self.entries.get(key)
        if e is not None:
            e.score = e.score * 2.0 ** (-(now - e.last) / self.half_life_s) + 1.0
            e.count += 1.0
            e.last = now

    def admit(self, key: int, size: int, now: float, hits: float = 1.0, pinned: bool = False) -> tuple[bool, list[int]]:
        """Try to make `key` warm with initial score `hits`; returns (admitted, evicted keys)."""
        if key in self.entries:  # accesses are recorded through `touch`, not by re-admission
            return True, []
        if size > self.capacity:
            return False, []
        need = self.used + size - self.capacity
        victims: list[int] = []
        mine = hits if self.lfu_weight is None else self._blend(hits, now, now)
        if need > 0:
            cands = sorted((self.score(k, now), k) for k, e in self.entries.items() if not e.pinned)
            freed = 0
            for sc, k in cands:
                if freed >= need:
                    break
                if sc >= mine and not pinned:
                    return False, []
                victims.append(k)
                freed += self.entries[k].size
            if freed < need:
                return False, []
        for k in victims:
            self.used -= self.entries.pop(k).size
        self.entries[key] = Entry(size, hits, now, pinned, hits)
        self.used += size
        return True, victims

    def discard(self, key: int) -> None:
        """Forget a prefix (its blocks were evicted elsewhere)."""
        e = self.entries.pop(key, None)
        if e is not None:
            self.used -= e.size
