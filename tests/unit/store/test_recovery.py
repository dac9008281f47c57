"""Recovery = snapshot + log replay reproduces the cache-manager state exactly (file and real Redis)."""

from __future__ import annotations

import random
from collections.abc import Iterator
from pathlib import Path

import pytest

from kvmesh.cachemgr.checkpoint import recover, snapshot_state
from kvmesh.cachemgr.hasher import IndexHasher
from kvmesh.cachemgr.ingest import Ingestor
from kvmesh.core.kvevents import KvEventBatch
from kvmesh.index import PrefixIndex
from kvmesh.ops.warming import PrefixStats
from kvmesh.store import FileCheckpointStore
from kvmesh.store.base import CheckpointStore
from kvmesh.store.redis_store import RedisCheckpointStore
from kvmesh.wire import ingest_log as codec
from tests.support.redis_server import RedisServer, redis_server_fixture
from tests.unit.cachemgr.test_ingest_state import BS, ToyEngine


@pytest.fixture
def redis_server(tmp_path: Path) -> Iterator[RedisServer]:
    yield from redis_server_fixture(tmp_path / "redis")


def pairs(idx: PrefixIndex) -> set[tuple[str, int]]:
    return set(idx.iter_pairs())


def state(ing: Ingestor) -> dict[str, tuple]:
    return {
        w: (s.instance_id, s.next_sequence, s.phase, dict(s.hashes.live), dict(s.hashes.extra), sorted(s.pending))
        for w, s in ing.workers.items()
    }


async def run_and_recover(store: CheckpointStore) -> None:
    rng = random.Random(3)
    hasher = IndexHasher("toy")
    idx = PrefixIndex()
    ing = Ingestor(idx, hasher, BS)
    stats = PrefixStats()
    engines = {w: ToyEngine(w, hasher, seed=i) for i, w in enumerate("abcd")}
    prefixes = [[rng.randrange(100) for _ in range(16)] for _ in range(3)]
    log: list[bytes] = []

    async def feed(b: KvEventBatch) -> None:
        rec = codec.encode_record(codec.LogRecord(codec.BATCH, b.worker_id, batch=b))
        ing.apply(b)
        log.append(rec)
        await store.append([rec])

    for step in range(120):
        eng = engines[rng.choice("abcd")]
        b = (
            eng.prompt(rng.choice(prefixes) + [rng.randrange(100) for _ in range(rng.randrange(9))])
            if rng.random() < 0.7
            else eng.evict(3, rng)
        )
        if step == 50:
            await store.save_snapshot(snapshot_state(idx, ing, stats))
        if step == 90:  # a lost batch: worker c is mid-replay when the cache-manager dies
            engines["c"].prompt([1, 2, 3, 4])
            b = engines["c"].prompt([5, 6, 7, 8])
        stats.observe([int(x) for x in hasher.chain(None, list(range(step % 7 * 4)), BS, None)], step)
        await feed(b)
    assert ing.workers["c"].pending  # the snapshot/log must carry the replay buffer too

    got = await recover(reopen(store), hasher, BS)
    assert got.restored is not None and got.records == 70  # steps 50..119 (snapshot taken before step 50)
    assert pairs(got.restored.index) == pairs(idx) and len(pairs(idx)) > 40
    assert state(got.restored.ingestor) == state(ing)
    q = hasher.chain(None, prefixes[0], BS, None)
    assert got.restored.index.find_matches(q) == idx.find_matches(q)
    # the recovered state continues: the next live batch is applied, no spurious gap
    nxt = engines["a"].prompt(prefixes[1] + [99] * 4)
    r1, r2 = ing.apply(nxt), got.restored.ingestor.apply(nxt)
    assert r1.applied == r2.applied == [nxt.sequence] and pairs(got.restored.index) == pairs(idx)


def reopen(s: CheckpointStore) -> CheckpointStore:
    if isinstance(s, FileCheckpointStore):
        return FileCheckpointStore(s.dir)
    assert isinstance(s, RedisCheckpointStore)
    return RedisCheckpointStore(s.r, s.prefix)


@pytest.mark.unit
async def test_file_recovery_equals_state_before(tmp_path: Path) -> None:
    await run_and_recover(FileCheckpointStore(tmp_path / "ck", fsync_appends=False))


@pytest.mark.integration
async def test_redis_recovery_equals_state_before(redis_server: RedisServer) -> None:
    s = RedisCheckpointStore.from_url(redis_server.url, prefix="rec")
    await run_and_recover(s)
    await s.close()


@pytest.mark.unit
def test_record_codec_roundtrip() -> None:
    eng = ToyEngine("w", IndexHasher("m"), seed=1)
    b = eng.prompt(list(range(12)))
    rec = codec.decode_record(codec.encode_record(codec.LogRecord(codec.BATCH, "w", batch=b)))
    assert rec.batch == b
    end = codec.decode_record(codec.encode_record(codec.LogRecord(codec.DUMP_END, "w", next_sequence=7)))
    assert (end.kind, end.worker_id, end.next_sequence) == (codec.DUMP_END, "w", 7)
