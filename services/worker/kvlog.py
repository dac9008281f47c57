"""The worker's KV event log: per-worker sequence numbers, a replay buffer, a mirror for consistent dumps.

Each engine batch becomes `KvEventBatch(sequence = previous + 1)` (the first is 1). The last `buffer`
batches stay for replay; `CacheMirror` holds the cache as of `last_seq`, so a dump taken at any moment is
exactly the state after batch `last_seq`. Consumers read through cursors (bounded queues); a cursor that
overflows is marked lost and its owner must fall back to a dump. No I/O, no clock.
"""

from __future__ import annotations

import asyncio
from collections import deque
from dataclasses import dataclass, field

from kvmesh.core.kvevents import BlockStored, KvEvent, KvEventBatch
from kvmesh.engine.mirror import CacheMirror


@dataclass
class Cursor:
    """A consumer's view of the log: batches appended after it was opened, in order."""

    queue: asyncio.Queue[KvEventBatch] = field(default_factory=asyncio.Queue)
    lost: bool = False


class KvEventLog:
    def __init__(self, worker_id: str, instance_id: str, buffer: int = 10_000, cursor_limit: int = 10_000) -> None:
        self.worker_id = worker_id
        self.instance_id = instance_id
        self.last_seq = 0
        self.mirror = CacheMirror()
        self._buffer: deque[KvEventBatch] = deque(maxlen=buffer)
        self._cursors: list[Cursor] = []
        self._cursor_limit = cursor_limit

    def append(self, events: list[KvEvent] | tuple[KvEvent, ...], timestamp: float) -> KvEventBatch:
        """Number the batch, apply it to the mirror, buffer it and hand it to every cursor."""
        self.last_seq += 1
        batch = KvEventBatch(self.worker_id, self.instance_id, self.last_seq, timestamp, tuple(events))
        for ev in batch.events:
            self.mirror.apply(ev)
        self._buffer.append(batch)
        for c in self._cursors:
            if c.lost:
                continue
            if c.queue.qsize() >= self._cursor_limit:
                c.lost = True
                continue
            c.queue.put_nowait(batch)
        return batch

    def replay(self, start_seq: int) -> list[KvEventBatch] | None:
        """Batches with sequence >= start_seq, or None if some of them are no longer buffered."""
        if start_seq < 1 or start_seq > self.last_seq + 1:
            return None
        if start_seq == self.last_seq + 1:
            return []
        if not self._buffer or self._buffer[0].sequence > start_seq:
            return None
        return [b for b in self._buffer if b.sequence >= start_seq]

    def dump(self) -> tuple[int, list[BlockStored]]:
        """(last_seq, the cache after that batch as single-block BlockStored events, parents first)."""
        return self.last_seq, self.mirror.dump()

    def open_cursor(self) -> Cursor:
        c = Cursor()
        self._cursors.append(c)
        return c

    def close_cursor(self, c: Cursor) -> None:
        if c in self._cursors:
            self._cursors.remove(c)
