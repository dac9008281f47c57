"""The cache-manager's journal of recent index deltas, by revision: what a resumed WatchIndex sends.

Each revision r of the index (one applied input that changed it) is an `Entry(r, at, deltas)`, `at` its ingest
time. Revisions are consecutive; the journal keeps the last `capacity` entries (the oldest go first), so it
covers the revisions (base, last]. A subscriber that applied revision R counted in epoch E resumes when

    E == the journal's epoch  and  base ≤ R ≤ last

and receives exactly the entries after R; otherwise (another epoch: a restarted or restored cache-manager;
R older than the journal; R ahead of it) it needs a snapshot. Pure: no I/O, no clock (`at` is given).
"""

from __future__ import annotations

import itertools
from collections import deque
from dataclasses import dataclass

from kvmesh.index.types import IndexDelta


@dataclass(frozen=True, slots=True)
class Entry:
    """The deltas of one revision, and when they were ingested (seconds since the Unix epoch)."""

    revision: int
    at: float
    deltas: tuple[IndexDelta, ...]

    def for_workers(self, workers: frozenset[str]) -> Entry | None:
        """The entry restricted to `workers` (empty = all); None when nothing of it is theirs."""
        if not workers:
            return self
        mine = tuple(d for d in self.deltas if d.worker in workers)
        return Entry(self.revision, self.at, mine) if mine else None


class DeltaJournal:
    """The last `capacity` revisions of one epoch (see the module docstring)."""

    def __init__(self, capacity: int, epoch: str, revision: int = 0) -> None:
        if capacity < 0:
            raise ValueError(f"journal capacity must be >= 0, got {capacity}")
        self.capacity = capacity
        self.epoch = epoch
        self.base = revision  # the revision just before the oldest entry
        self._entries: deque[Entry] = deque()

    @property
    def last(self) -> int:
        """The newest revision (= base when empty)."""
        return self.base + len(self._entries)

    def __len__(self) -> int:
        return len(self._entries)

    def append(self, entry: Entry) -> None:
        """Record the next revision (it must follow `last`)."""
        if entry.revision != self.last + 1:
            raise ValueError(f"journal revision {entry.revision} does not follow {self.last}")
        self._entries.append(entry)
        while len(self._entries) > self.capacity:
            self.base = self._entries.popleft().revision

    def since(self, epoch: str, revision: int) -> list[Entry] | None:
        """The entries after `revision` of `epoch`, or None when the journal cannot tell them all."""
        if epoch != self.epoch or not self.base <= revision <= self.last:
            return None
        return list(itertools.islice(self._entries, revision - self.base, None))

    def reset(self, epoch: str, revision: int) -> None:
        """Start a new epoch at `revision` (after a restore: the old revisions no longer describe the index)."""
        self.epoch, self.base = epoch, revision
        self._entries.clear()
