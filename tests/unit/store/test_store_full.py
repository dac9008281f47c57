"""A full or lost checkpoint store: kvmesh's own errors (RESOURCE_EXHAUSTED with retry info when full), the
previous snapshot and log left whole, and the store usable again once space is back.

The full stores are real: a small tmpfs mounted for the test (ENOSPC from the kernel) and a redis-server at
its memory limit with no eviction (its OOM reply). The cache-manager's part, no append after a hole in the log
until a checkpoint, is checked on `CacheCore` with a store that fails when told to.
"""

from __future__ import annotations

import contextlib
import errno
import subprocess
from collections.abc import Iterator, Sequence
from pathlib import Path

import pytest
import redis

from kvmesh.cachemgr.core import CacheCore
from kvmesh.core.errors import ResourceExhausted, Unavailable
from kvmesh.core.kvevents import BlockStored, KvEventBatch
from kvmesh.store import FileCheckpointStore
from kvmesh.store.base import RETRY_AFTER_S, Loaded
from kvmesh.store.redis_store import RedisCheckpointStore
from tests.support.redis_server import RedisServer, redis_server_fixture


@pytest.fixture
def small_tmpfs(tmp_path: Path) -> Iterator[Path]:
    """A 1 MiB tmpfs (root only, as the namespace tests)."""
    path = tmp_path / "tmpfs"
    path.mkdir()
    done = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=1m", "tmpfs", str(path)], capture_output=True)
    if done.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here: {done.stderr.decode().strip()}")
    try:
        yield path
    finally:
        subprocess.run(["umount", "-l", str(path)], check=False)


def fill(path: Path) -> None:
    """Writes until the filesystem holding `path` is full."""
    with open(path, "wb", buffering=0) as fh, contextlib.suppress(OSError):
        while fh.write(bytes(64 << 10)):
            pass
        while fh.write(b"\0"):
            pass


@pytest.mark.integration
async def test_a_full_directory_refuses_a_snapshot_with_resource_exhausted_and_keeps_the_last_one(
    small_tmpfs: Path,
) -> None:
    s = FileCheckpointStore(small_tmpfs / "ckpt")
    await s.save_snapshot(b"first" * 100)
    await s.append([b"r1", b"r2"])
    fill(small_tmpfs / "filler")
    with pytest.raises(ResourceExhausted, match="is full") as e:
        await s.save_snapshot(b"second" * 50_000)
    assert str(small_tmpfs / "ckpt") in str(e.value) and e.value.retry_after_s == RETRY_AFTER_S
    assert not list((small_tmpfs / "ckpt").glob(".snapshot.*")), "a half-written snapshot holds the space"
    loaded = FileCheckpointStore(small_tmpfs / "ckpt").load_sync()
    assert (loaded.snapshot, loaded.records) == (b"first" * 100, [b"r1", b"r2"])
    (small_tmpfs / "filler").unlink()
    await s.save_snapshot(b"second" * 50_000)
    assert FileCheckpointStore(small_tmpfs / "ckpt").load_sync().snapshot == b"second" * 50_000


@pytest.mark.integration
async def test_an_append_into_a_full_directory_leaves_the_log_on_a_whole_record(small_tmpfs: Path) -> None:
    s = FileCheckpointStore(small_tmpfs / "ckpt", fsync_appends=False)
    await s.save_snapshot(b"snap")
    await s.append([b"kept"])
    fill(small_tmpfs / "filler")
    with pytest.raises(ResourceExhausted, match="appending to the log"):
        await s.append([b"x" * 200_000])
    (small_tmpfs / "filler").unlink()
    await s.append([b"after"])  # follows the whole record, not a torn tail
    assert FileCheckpointStore(small_tmpfs / "ckpt").load_sync().records == [b"kept", b"after"]


@pytest.mark.integration
async def test_a_store_directory_that_cannot_be_written_is_unavailable(tmp_path: Path) -> None:
    s = FileCheckpointStore(tmp_path / "ckpt")
    (tmp_path / "ckpt").rmdir()
    (tmp_path / "ckpt").write_text("a file where the store's directory was")
    with pytest.raises(Unavailable, match="writing the snapshot"):
        await s.save_snapshot(b"snap")


@pytest.fixture
def redis_server(tmp_path: Path) -> Iterator[RedisServer]:
    yield from redis_server_fixture(tmp_path / "redis")


def hold_at_limit(srv: RedisServer) -> redis.Redis:
    client = redis.Redis(host="127.0.0.1", port=srv.port)
    used = int(client.info("memory")["used_memory"])
    client.config_set("maxmemory-policy", "noeviction")
    client.config_set("maxmemory", str(used // 2))
    return client


@pytest.mark.integration
async def test_redis_at_its_memory_limit_refuses_whole_batches_with_resource_exhausted(
    redis_server: RedisServer,
) -> None:
    s = RedisCheckpointStore.from_url(redis_server.url, prefix="full")
    try:
        await s.save_snapshot(b"first")
        await s.append([b"r1"])
        client = hold_at_limit(redis_server)
        with pytest.raises(ResourceExhausted, match="is full") as e:
            await s.save_snapshot(b"second")
        assert e.value.retry_after_s == RETRY_AFTER_S
        with pytest.raises(ResourceExhausted, match="appending to the log"):
            await s.append([b"r2", b"r3"])
        loaded = await RedisCheckpointStore(s.r, "full").load()
        assert (loaded.snapshot, loaded.records) == (b"first", [b"r1"])  # nothing of either write
        client.config_set("maxmemory", "0")
        await s.append([b"r2"])
        assert (await RedisCheckpointStore(s.r, "full").load()).records == [b"r1", b"r2"]
    finally:
        await s.close()


@pytest.mark.integration
async def test_a_redis_that_is_gone_is_unavailable(redis_server: RedisServer) -> None:
    s = RedisCheckpointStore.from_url(redis_server.url, prefix="gone")
    try:
        await s.save_snapshot(b"first")
        redis_server.proc.kill()
        redis_server.proc.wait(10)
        with pytest.raises(Unavailable, match="checkpoint store redis gone"):
            await s.append([b"r1"])
    finally:
        await s.close()


class FailingStore:
    """A `CheckpointStore` in memory whose writes fail while `full` (a stand-in: the stores' own failures are
    checked above against real ones)."""

    def __init__(self) -> None:
        self.full = False
        self.snapshot: bytes | None = None
        self.records: list[bytes] = []
        self.epoch = 0

    async def load(self) -> Loaded:
        return Loaded(self.snapshot, self.epoch, list(self.records))

    async def save_snapshot(self, snapshot: bytes) -> int:
        if self.full:
            raise ResourceExhausted("checkpoint store full", RETRY_AFTER_S)
        self.snapshot, self.records, self.epoch = snapshot, [], self.epoch + 1
        return self.epoch

    async def append(self, records: Sequence[bytes]) -> None:
        if self.full:
            raise ResourceExhausted("checkpoint store full", RETRY_AFTER_S)
        self.records += records

    async def close(self) -> None:
        pass


def stored(core: CacheCore, worker: str, seq: int, h: int, parent: int | None) -> None:
    ev = BlockStored((h,), parent, tuple(range(16 * seq, 16 * seq + 16)), 16)
    core.apply(KvEventBatch(worker, "i", seq, float(seq), (ev,)))


async def test_after_a_failed_append_nothing_is_appended_until_a_checkpoint_succeeds() -> None:
    store = FailingStore()
    core = CacheCore(16, "m", store=store)
    await core.checkpoint()
    stored(core, "w", 1, 11, None)
    await core.persist()
    assert len(store.records) == 1
    store.full = True
    stored(core, "w", 2, 12, 11)
    with pytest.raises(ResourceExhausted):
        await core.persist()
    store.full = False
    stored(core, "w", 3, 13, 12)
    await core.persist()
    assert len(store.records) == 1, "a record appended after the lost one would replay onto the wrong state"
    with pytest.raises(ResourceExhausted):
        store.full = True
        await core.checkpoint()
    store.full = False
    await core.persist()
    assert len(store.records) == 1
    await core.checkpoint()  # holds every block; the log starts again
    stored(core, "w", 4, 14, 13)
    await core.persist()
    assert len(store.records) == 1 and store.epoch == 2
    restored = CacheCore(16, "m", store=store)
    await restored.restore()
    assert sorted(int(h) for h in restored.index.blocks_of("w")) == sorted(int(h) for h in core.index.blocks_of("w"))


def test_the_errno_of_a_full_disk_is_what_the_file_store_calls_full() -> None:
    s = FileCheckpointStore.__new__(FileCheckpointStore)
    s.dir = Path("/x")
    assert isinstance(s._error(OSError(errno.ENOSPC, "No space left"), "w"), ResourceExhausted)
    assert isinstance(s._error(OSError(errno.EDQUOT, "Quota"), "w"), ResourceExhausted)
    assert isinstance(s._error(OSError(errno.EIO, "I/O error"), "w"), Unavailable)
