"""Checkpoint stores: file (atomic snapshot, torn log tail) and Redis (real redis-server)."""

from __future__ import annotations

from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import pytest

from kvmesh.store import FileCheckpointStore
from kvmesh.store.base import CheckpointStore
from kvmesh.store.redis_store import RedisCheckpointStore
from tests.support.redis_server import RedisServer, redis_server_fixture


@pytest.fixture
def redis_server(tmp_path: Path) -> Iterator[RedisServer]:
    yield from redis_server_fixture(tmp_path / "redis")


@pytest.fixture(params=["file", "redis"])
async def store(request: pytest.FixtureRequest, tmp_path: Path) -> AsyncIterator[CheckpointStore]:
    if request.param == "file":
        s: CheckpointStore = FileCheckpointStore(tmp_path / "ckpt")
    else:
        srv = request.getfixturevalue("redis_server")
        s = RedisCheckpointStore.from_url(srv.url, prefix="t")
    yield s
    await s.close()


def reopen(s: CheckpointStore) -> CheckpointStore:
    if isinstance(s, FileCheckpointStore):
        return FileCheckpointStore(s.dir)
    assert isinstance(s, RedisCheckpointStore)
    return RedisCheckpointStore(s.r, s.prefix)


@pytest.mark.integration
async def test_snapshot_then_log_roundtrip(store: CheckpointStore) -> None:
    loaded = await store.load()
    assert loaded.snapshot is None and loaded.records == []
    await store.append([b"before-1", b"before-2"])
    assert (await reopen(store).load()).records == [b"before-1", b"before-2"]
    epoch = await store.save_snapshot(b"S1" * 1000)
    await store.append([b"a", b""])
    await store.append([b"c" * 70_000])
    other = reopen(store)
    got = await other.load()
    assert got.snapshot == b"S1" * 1000 and got.epoch == epoch
    assert got.records == [b"a", b"", b"c" * 70_000]  # the log before the snapshot is gone
    # the reopened store continues the same epoch's log
    await other.append([b"d"])
    assert (await reopen(store).load()).records == [b"a", b"", b"c" * 70_000, b"d"]
    await store.save_snapshot(b"S2")
    got = await reopen(store).load()
    assert got.snapshot == b"S2" and got.records == [] and got.epoch == epoch + 1


@pytest.mark.unit
def test_file_store_ignores_torn_tail_and_rejects_corrupt_snapshot(tmp_path: Path) -> None:
    s = FileCheckpointStore(tmp_path)
    s.save_snapshot_sync(b"snap")
    s.append_sync([b"one", b"two"])
    s._close_log()
    log = tmp_path / "log.1.bin"
    with open(log, "ab") as f:
        f.write(b"\x10\x00\x00\x00\x00\x00")  # a record header cut short by a crash
    assert FileCheckpointStore(tmp_path).load_sync().records == [b"one", b"two"]
    assert not list(tmp_path.glob(".snapshot.*"))  # no temp file left behind
    raw = bytearray((tmp_path / "snapshot.bin").read_bytes())
    raw[-1] ^= 0xFF
    (tmp_path / "snapshot.bin").write_bytes(bytes(raw))
    with pytest.raises(ValueError, match="checksum"):
        FileCheckpointStore(tmp_path).load_sync()


@pytest.mark.integration
async def test_redis_large_log_reads_in_chunks(redis_server: RedisServer) -> None:
    s = RedisCheckpointStore.from_url(redis_server.url, prefix="big")
    s.read_chunk = 1000
    await s.save_snapshot(b"x")
    recs = [i.to_bytes(4, "big") for i in range(4500)]
    for i in range(0, len(recs), 700):
        await s.append(recs[i : i + 700])
    got = await RedisCheckpointStore(s.r, "big").load()
    assert got.records == recs
    await s.close()
