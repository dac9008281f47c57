"""A bounded cache of tokenised texts: the same text gives the same token ids, so a repeated prompt (a retry,
a fixed few-shot or system prompt sent as a whole, a benchmark's prompt set) is tokenised once.

Sound by construction: a hit needs the very text (dict lookup compares the strings, not only their hashes)
and the cache belongs to one tokenizer. Entries are kept apart by a scope (the router's: the tenant), so how
fast a text is tokenised tells no one whether another tenant sent it. The ids are kept encoded, as the
caller's bytes (the router keeps a serialized `kvmesh.v1.TokenIds`: 2-3 bytes per id where a tuple of
ints takes 36, and parsed back 4x faster than a message is built from a list). Least recently used entries
go first once the cache holds more than its byte budget; an entry is charged the sizes of its text and bytes
objects, so the budget is what the entries hold in memory, within a few per cent.
"""

from __future__ import annotations

import sys
from collections import OrderedDict
from dataclasses import dataclass


@dataclass
class TokenCacheStats:
    hits: int = 0
    misses: int = 0
    evictions: int = 0
    entries: int = 0
    bytes: int = 0


class TokenCache:
    """text → its encoded token ids, at most `max_bytes` in all; `max_bytes` 0 turns it off (every lookup a
    miss, nothing kept). A text too large for the budget on its own is not kept."""

    def __init__(self, max_bytes: int) -> None:
        if max_bytes < 0:
            raise ValueError(f"max_bytes must be >= 0, got {max_bytes}")
        self.max_bytes = max_bytes
        self.stats = TokenCacheStats()
        self._entries: OrderedDict[tuple[str, str], bytes] = OrderedDict()

    def get(self, text: str, scope: str = "") -> bytes | None:
        """The encoded ids of `text` put in `scope` (immutable bytes), or None; a hit becomes the most recently
        used entry."""
        key = (scope, text)
        ids = self._entries.get(key)
        if ids is None:
            self.stats.misses += 1
            return None
        self._entries.move_to_end(key)
        self.stats.hits += 1
        return ids

    def put(self, text: str, ids: bytes, scope: str = "") -> None:
        """Keeps `ids` (encoded) as the tokenisation of `text` in `scope`, evicting the least recently used
        entries over budget."""
        size = entry_bytes(text, ids)
        key = (scope, text)
        if size > self.max_bytes or key in self._entries:
            return
        self._entries[key] = ids
        self.stats.bytes += size
        while self.stats.bytes > self.max_bytes:
            (_, old_text), old_ids = self._entries.popitem(last=False)
            self.stats.bytes -= entry_bytes(old_text, old_ids)
            self.stats.evictions += 1
        self.stats.entries = len(self._entries)


def entry_bytes(text: str, ids: bytes) -> int:
    """What one entry holds: the text and the bytes objects."""
    return sys.getsizeof(text) + sys.getsizeof(ids)
