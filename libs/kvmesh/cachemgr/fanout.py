"""Watch fan-out: index deltas to subscribers, each with a bounded queue.

A subscriber that falls `max_queue` messages behind is dropped (its stream ends with an error and it
must re-subscribe, resuming from its last revision while the journal still holds it, else from a fresh
snapshot): a slow replica is never left silently wrong.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field

from kvmesh.cachemgr.journal import Entry


@dataclass(eq=False)
class Watcher:
    """One subscriber: journal entries (its workers' deltas of each revision), `None` = dropped (overflow)."""

    workers: frozenset[str]
    queue: asyncio.Queue[Entry | None] = field(default_factory=lambda: asyncio.Queue(maxsize=10_000))


class FanOut:
    """Publishes journal entries to every watcher (non-blocking)."""

    def __init__(self) -> None:
        self.watchers: set[Watcher] = set()

    def add(self, workers: frozenset[str]) -> Watcher:
        w = Watcher(workers)
        self.watchers.add(w)
        return w

    def remove(self, w: Watcher) -> None:
        self.watchers.discard(w)

    def publish(self, entry: Entry) -> None:
        """Queue `entry` to every watcher (filtered by worker); overflowing watchers are dropped."""
        if not entry.deltas:
            return
        for w in list(self.watchers):
            mine = entry.for_workers(w.workers)
            if mine is None:
                continue
            if w.queue.qsize() >= w.queue.maxsize - 1:
                self.watchers.discard(w)
                w.queue.put_nowait(None)
                continue
            w.queue.put_nowait(mine)
