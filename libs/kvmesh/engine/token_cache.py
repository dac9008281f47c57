"""A bounded cache of tokenised texts: the same text gives the same token ids, so a repeated prompt (a retry,
a fixed few-shot or system prompt sent as a whole, a benchmark's prompt set) is tokenised once.

Sound by construction: a hit needs the very text (dict lookup compares the strings, not only their hashes)
and the cache belongs to one tokenizer. Entries are kept apart by a scope (the router's: the tenant), so how
fast a text is tokenised tells no one whether another tenant sent it. The ids are kept encoded, as the
caller's bytes (the router keeps a serialized `kvmesh.v1.TokenIds`: 2-3 bytes per id where a tuple of
ints takes 36, and parsed back 4x faster than a message is built from a list). Least recently used entries
go first once the cache holds more than its byte budget; an entry is charged the sizes of its text and bytes
objects, so the budget is what the entries hold in memory, within a few per cent.

Admission (TinyLFU): a full cache takes a new text only if it has been looked up more often than each entry it
would displace (a count-min sketch of lookups, halved every ``10 × width`` lookups so that old popularity
fades). Plain LRU gets no hit at all when a set of texts slightly larger than the budget comes round in a
cycle (each is evicted just before it returns); with admission the entries stay and the cycle hits
budget / set size of the time, while a text that becomes popular still gets in after a few lookups. The sketch
counts (scope, text) pairs, so one tenant's lookups raise another's count only through a hash collision of
the sketch, which no caller can aim at (Python's string hash is keyed per process).
"""

from __future__ import annotations

import sys
from collections import OrderedDict
from dataclasses import dataclass

_M64 = (1 << 64) - 1


@dataclass
class TokenCacheStats:
    hits: int = 0
    misses: int = 0
    evictions: int = 0
    rejections: int = 0  # texts not admitted: looked up no more often than the entries they would displace
    entries: int = 0
    bytes: int = 0


class FrequencySketch:
    """Approximate lookup counts: count-min over 4 rows of ``width`` counters saturating at 15, every count
    halved after ``10 × width`` increments (TinyLFU's reset). ``width`` a power of two, at most 65,536."""

    ROWS = 4
    MAX_COUNT = 15

    def __init__(self, width: int = 4096) -> None:
        if width < 1 or width & (width - 1) or width > 1 << 16:
            raise ValueError(f"width must be a power of two <= 65536, got {width}")
        self._mask = width - 1
        self._rows = [[0] * width for _ in range(self.ROWS)]
        self._sample = 10 * width
        self._added = 0

    def _slots(self, h: int) -> list[int]:
        h = ((h & _M64) * 0x9E3779B97F4A7C15) & _M64  # spread a weak hash over all 64 bits
        return [(h >> (16 * i)) & self._mask for i in range(self.ROWS)]

    def add(self, h: int) -> None:
        """Counts one lookup of the item hashing to ``h``."""
        for row, i in zip(self._rows, self._slots(h), strict=True):
            if row[i] < self.MAX_COUNT:
                row[i] += 1
        self._added += 1
        if self._added >= self._sample:
            self._rows = [[c >> 1 for c in row] for row in self._rows]
            self._added //= 2

    def estimate(self, h: int) -> int:
        """At least the lookups counted (since the halvings) for ``h``; more only through collisions."""
        return min(row[i] for row, i in zip(self._rows, self._slots(h), strict=True))


class TokenCache:
    """text → its encoded token ids, at most `max_bytes` in all; `max_bytes` 0 turns it off (every lookup a
    miss, nothing kept). A text too large for the budget on its own is not kept."""

    def __init__(self, max_bytes: int, sketch_width: int = 4096) -> None:
        if max_bytes < 0:
            raise ValueError(f"max_bytes must be >= 0, got {max_bytes}")
        self.max_bytes = max_bytes
        self.stats = TokenCacheStats()
        self._entries: OrderedDict[tuple[str, str], bytes] = OrderedDict()
        self._sketch = FrequencySketch(sketch_width)

    def get(self, text: str, scope: str = "") -> bytes | None:
        """The encoded ids of `text` put in `scope` (immutable bytes), or None; a hit becomes the most recently
        used entry."""
        key = (scope, text)
        if self.max_bytes:
            self._sketch.add(hash(key))
        ids = self._entries.get(key)
        if ids is None:
            self.stats.misses += 1
            return None
        self._entries.move_to_end(key)
        self.stats.hits += 1
        return ids

    def put(self, text: str, ids: bytes, scope: str = "") -> None:
        """Keeps `ids` (encoded) as the tokenisation of `text` in `scope` if there is room, or if `text` was
        looked up more often than the least recently used entries it displaces (see the module docstring)."""
        size = entry_bytes(text, ids)
        key = (scope, text)
        if size > self.max_bytes or key in self._entries:
            return
        victims = self._victims(self.stats.bytes + size - self.max_bytes)
        if victims:
            wanted = self._sketch.estimate(hash(key))
            if any(self._sketch.estimate(hash(v)) >= wanted for v in victims):
                self.stats.rejections += 1
                return
        for v in victims:
            self.stats.bytes -= entry_bytes(v[1], self._entries.pop(v))
            self.stats.evictions += 1
        self._entries[key] = ids
        self.stats.bytes += size
        self.stats.entries = len(self._entries)

    def _victims(self, excess: int) -> list[tuple[str, str]]:
        """The least recently used keys whose entries free at least ``excess`` bytes (none if <= 0)."""
        out: list[tuple[str, str]] = []
        for key, ids in self._entries.items():
            if excess <= 0:
                break
            out.append(key)
            excess -= entry_bytes(key[1], ids)
        return out


def entry_bytes(text: str, ids: bytes) -> int:
    """What one entry holds: the text and the bytes objects."""
    return sys.getsizeof(text) + sys.getsizeof(ids)
