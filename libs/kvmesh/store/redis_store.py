"""Redis checkpoint store (redis-py asyncio): a snapshot key + one event-log stream per epoch.

Keys under `prefix` (e.g. `kvmesh:cm:zone-a`): `<prefix>:snapshot` (hash: `epoch`, `data`) and
`<prefix>:log:<epoch>` (a stream; each record one XADD with field `r`). `save_snapshot` writes the new
snapshot and deletes the previous epoch's stream in one MULTI/EXEC transaction, so a reader sees either
(old snapshot, old log) or (new snapshot, new log). Appends are pipelined XADDs to the current stream.
"""

from __future__ import annotations

from collections.abc import Sequence

from redis.asyncio import Redis

from kvmesh.store.base import Loaded


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

    async def save_snapshot(self, snapshot: bytes) -> int:
        """See `CheckpointStore.save_snapshot` (one MULTI/EXEC)."""
        new_epoch = self.epoch + 1
        async with self.r.pipeline(transaction=True) as p:
            p.hset(f"{self.prefix}:snapshot", mapping={"epoch": new_epoch, "data": snapshot})
            p.delete(self._log_key(self.epoch))
            await p.execute()
        self.epoch = new_epoch
        return new_epoch

    async def append(self, records: Sequence[bytes]) -> None:
        """See `CheckpointStore.append` (one pipelined round trip)."""
        if not records:
            return
        key = self._log_key(self.epoch)
        async with self.r.pipeline(transaction=False) as p:
            for rec in records:
                p.xadd(key, {"r": rec})
            await p.execute()

    async def close(self) -> None:
        """See `CheckpointStore.close`."""
        await self.r.aclose()
