"""Watch fan-out: index deltas to subscribers, each with a bounded queue.

A subscriber that falls `max_queue` messages behind is dropped (its stream ends with an error and it
must re-subscribe, getting a fresh snapshot): a slow replica is never left silently wrong.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field

from kvmesh.cachemgr.types import IndexDelta


@dataclass(eq=False)
class Watcher:
    """One subscriber: revisions and deltas, `None` = dropped (overflow)."""

    workers: frozenset[str]
    queue: asyncio.Queue[tuple[int, list[IndexDelta]] | None] = field(
        default_factory=lambda: asyncio.Queue(maxsize=10_000)
    )


class FanOut:
    """Publishes delta lists to every watcher (non-blocking)."""

    def __init__(self) -> None:
        self.watchers: set[Watcher] = set()

    def add(self, workers: frozenset[str]) -> Watcher:
        w = Watcher(workers)
        self.watchers.add(w)
        return w

    def remove(self, w: Watcher) -> None:
        self.watchers.discard(w)

    def publish(self, revision: int, deltas: list[IndexDelta]) -> None:
        """Queue `deltas` to every watcher (filtered by worker); overflowing watchers are dropped."""
        if not deltas:
            return
        for w in list(self.watchers):
            mine = deltas if not w.workers else [d for d in deltas if d.worker in w.workers]
            if not mine:
                continue
            if w.queue.qsize() >= w.queue.maxsize - 1:
                self.watchers.discard(w)
                w.queue.put_nowait(None)
                continue
            w.queue.put_nowait((revision, mine))
