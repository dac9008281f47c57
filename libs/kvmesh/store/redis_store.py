"""Redis checkpoint store (redis-py asyncio): a snapshot key + one event-log stream per epoch.

Keys under `prefix` (e.g. `kvmesh:cm:zone-a`): `<prefix>:snapshot` (hash: `epoch`, `data`) and
`<prefix>:log:<epoch>` (a stream; each record one XADD with field `r`). `save_snapshot` writes the new
snapshot and deletes the previous epoch's stream in one MULTI/EXEC transaction, so a reader sees either
(old snapshot, old log) or (new snapshot, new log). Appends are XADDs to the current stream, pipelined in one
MULTI/EXEC too: a Redis at its memory limit (no eviction) refuses the whole batch, never a part of it.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Sequence
from typing import TypeVar

import redis.exceptions
from redis.asyncio import Redis

from kvmesh.core.errors import KvmeshError, ResourceExhausted, Unavailable
from kvmesh.store.base import RETRY_AFTER_S, Loaded

T = TypeVar("T")


class RedisCheckpointStore:
    """`CheckpointStore` in Redis (see module docstring)."""

    def __init__(self, client: Redis, prefix: str = "kvmesh:cm", read_chunk: int = 10_000) -> None:
        self.r = client
        self.prefix = prefix
        self.read_chunk = read_chunk
        self.epoch = 0

    @classmethod
    def from_url(cls, url: str, prefix: str = "kvmesh:cm") -> RedisCheckpointStore:
        """Connect lazily to `redis://host:port/db`."""
        return cls(Redis.from_url(url), prefix)

    def _log_key(self, epoch: int) -> str:
        return f"{self.prefix}:log:{epoch}"

    async def load(self) -> Loaded:
        """See `CheckpointStore.load`; the stream is read in chunks of `read_chunk` entries."""
        snap: dict[bytes, bytes] = await self.r.hgetall(f"{self.prefix}:snapshot")  # type: ignore[misc,assignment]
        epoch = int(snap[b"epoch"]) if snap else 0
        self.epoch = epoch
        records: list[bytes] = []
        key, start = self._log_key(epoch), "-"
        for _ in range(1 << 40):  # bounded by the stream's length
            chunk: list[tuple[bytes, dict[bytes, bytes]]] = await self.r.xrange(  # type: ignore[assignment]
                key, min=start, max="+", count=self.read_chunk
            )
            if not chunk:
                break
            records += [fields[b"r"] for _id, fields in chunk]
            start = "(" + chunk[-1][0].decode()
            if len(chunk) < self.read_chunk:
                break
        return Loaded(snap[b"data"] if snap else None, epoch, records)

    def _error(self, e: redis.exceptions.RedisError, what: str) -> KvmeshError:
        """The store's error for a failed write (see `kvmesh.store.base`): Redis's OOM reply is a full store."""
        where = f"checkpoint store redis {self.prefix}: {what} failed: {e}"
        if _out_of_memory(e):
            return ResourceExhausted(f"{where} (the store is full)", RETRY_AFTER_S)
        return Unavailable(where)

    async def _write(self, what: str, write: Callable[[], Awaitable[T]]) -> T:
        try:
            return await write()
        except redis.exceptions.RedisError as e:
            raise self._error(e, what) from e

    async def save_snapshot(self, snapshot: bytes) -> int:
        """See `CheckpointStore.save_snapshot` (one MULTI/EXEC)."""
        new_epoch = self.epoch + 1

        async def write() -> None:
            async with self.r.pipeline(transaction=True) as p:
                p.hset(f"{self.prefix}:snapshot", mapping={"epoch": new_epoch, "data": snapshot})
                p.delete(self._log_key(self.epoch))
                await p.execute()

        await self._write("writing the snapshot", write)
        self.epoch = new_epoch
        return new_epoch

    async def append(self, records: Sequence[bytes]) -> None:
        """See `CheckpointStore.append` (one MULTI/EXEC round trip: all the records or none)."""
        if not records:
            return
        key = self._log_key(self.epoch)

        async def write() -> None:
            async with self.r.pipeline(transaction=True) as p:
                for rec in records:
                    p.xadd(key, {"r": rec})
                await p.execute()

        await self._write("appending to the log", write)

    async def close(self) -> None:
        """See `CheckpointStore.close`."""
        await self.r.aclose()


def _out_of_memory(e: BaseException | None) -> bool:
    """Whether Redis refused for its memory limit: its OOM reply, as raised or as the cause of a transaction's
    EXECABORT."""
    for _ in range(8):  # a short chain of causes
        if e is None:
            return False
        if isinstance(e, redis.exceptions.OutOfMemoryError) or "maxmemory" in str(e):
            return True
        e = e.__cause__ or e.__context__
    return False
