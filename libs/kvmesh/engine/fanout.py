"""Fan-out of KV event batches to any number of async subscribers, each with a bounded queue.

A subscriber that falls `limit` batches behind is marked lost: its iterator drains what it has and then
raises `Unavailable`, telling the consumer to resync from `Engine.dump_blocks()`. Never a silent gap.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncGenerator

from kvmesh.core.errors import Unavailable
from kvmesh.core.kvevents import KvEvent


class _Sub:
    def __init__(self, limit: int) -> None:
        self.queue: asyncio.Queue[list[KvEvent]] = asyncio.Queue(maxsize=limit)
        self.lost = False


class EventFanout:
    """`publish(batch)` from the engine side; `subscribe()` from each consumer."""

    def __init__(self, limit: int = 10_000) -> None:
        self._limit = limit
        self._subs: list[_Sub] = []
        self.closed = False

    def publish(self, events: list[KvEvent]) -> None:
        if not events:
            return
        for sub in self._subs:
            if sub.lost:
                continue
            try:
                sub.queue.put_nowait(events)
            except asyncio.QueueFull:
                sub.lost = True  # its queue is full, so its reader is not blocked: it drains, then raises

    def lose_all(self) -> None:
        """Tell every subscriber to resync (the engine lost track of its own events)."""
        for sub in self._subs:
            sub.lost = True
            if not sub.queue.full():
                sub.queue.put_nowait([])

    def close(self) -> None:
        self.closed = True
        self.lose_all()

    def subscribe(self) -> AsyncGenerator[list[KvEvent], None]:
        """Registers now (no batch published after this call is missed) and returns the iterator of
        every later batch; the iterator raises `Unavailable` once this subscriber is lost."""
        if self.closed:
            raise Unavailable("engine stopped")
        sub = _Sub(self._limit)
        self._subs.append(sub)
        return self._iterate(sub)

    async def _iterate(self, sub: _Sub) -> AsyncGenerator[list[KvEvent], None]:
        try:
            while True:
                if sub.lost and sub.queue.empty():
                    raise Unavailable("KV event subscriber fell behind or engine stopped; resync")
                batch = await sub.queue.get()
                if batch:
                    yield batch
        finally:
            self._subs.remove(sub)
