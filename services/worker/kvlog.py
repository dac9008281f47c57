"""The worker's KV event log: per-worker sequence numbers, a replay buffer, a mirror for consistent dumps.

Each engine batch becomes `KvEventBatch(sequence = previous + 1)` (the first is 1). The newest batches
stay for replay, at most `buffer` batches holding at most `buffer_blocks` blocks in all (`batch_blocks`):
a batch's size follows its prompts (a 3000-token prompt stores ~100 blocks with their token ids), so a
count of batches alone bounds nothing in bytes, and a replay longer than a few thousand blocks costs a
consumer about what the dump it falls back to costs. `CacheMirror` holds the cache as of `last_seq`, so a
dump taken at any moment is exactly the state after batch `last_seq`. Consumers read through cursors
(bounded queues); a cursor that overflows is marked lost and its owner must fall back to a dump. No I/O,
no clock.
"""

from __future__ import annotations

import asyncio
from collections import deque
from dataclasses import dataclass, field

from kvmesh.core.kvevents import BlockStored, KvEvent, KvEventBatch
from kvmesh.engine.mirror import CacheMirror

DEFAULT_BUFFER_BLOCKS = 4096  # ~1 KB a stored block with its token ids: a few MB of replay at most


def batch_blocks(batch: KvEventBatch) -> int:
    """The batch's weight in the replay buffer: the blocks its events name (an event naming none counts 1)."""
    return sum(max(1, len(getattr(ev, "block_hashes", ()))) for ev in batch.events)


@dataclass
class Cursor:
    """A consumer's view of the log: batches appended after it was opened, in order."""

    queue: asyncio.Queue[KvEventBatch] = field(default_factory=asyncio.Queue)
    lost: bool = False


class KvEventLog:
    def __init__(
        self,
        worker_id: str,
        instance_id: str,
        buffer: int = 10_000,
        cursor_limit: int = 10_000,
        buffer_blocks: int = DEFAULT_BUFFER_BLOCKS,
    ) -> None:
        self.worker_id = worker_id
        self.instance_id = instance_id
        self.last_seq = 0
        self.mirror = CacheMirror()
        self._buffer: deque[KvEventBatch] = deque(maxlen=buffer)
        self._buffer_blocks = buffer_blocks
        self._buffered_blocks = 0  # batch_blocks summed over _buffer
        self._cursors: list[Cursor] = []
        self._cursor_limit = cursor_limit

    def append(self, events: list[KvEvent] | tuple[KvEvent, ...], timestamp: float) -> KvEventBatch:
        """Number the batch, apply it to the mirror, buffer it and hand it to every cursor."""
        self.last_seq += 1
        batch = KvEventBatch(self.worker_id, self.instance_id, self.last_seq, timestamp, tuple(events))
        for ev in batch.events:
            self.mirror.apply(ev)
        self._buffer_append(batch)
        for c in self._cursors:
            if c.lost:
                continue
            if c.queue.qsize() >= self._cursor_limit:
                c.lost = True
                continue
            c.queue.put_nowait(batch)
        return batch

    def _buffer_append(self, batch: KvEventBatch) -> None:
        """Buffer the batch, dropping the oldest ones past `buffer` batches or `buffer_blocks` blocks (even
        the new one itself when it alone is over: a replay through it then answers None, i.e. dump)."""
        if self._buffer and len(self._buffer) == self._buffer.maxlen:
            self._buffered_blocks -= batch_blocks(self._buffer[0])  # the deque drops it on append
        self._buffer.append(batch)
        self._buffered_blocks += batch_blocks(batch)
        while self._buffer and self._buffered_blocks > self._buffer_blocks:
            self._buffered_blocks -= batch_blocks(self._buffer.popleft())

    @property
    def buffered_blocks(self) -> int:
        """Blocks the replay buffer holds now (at most `buffer_blocks`)."""
        return self._buffered_blocks

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
