"""Recovery benchmark: `python -m kvmesh.bench recovery --pairs 1000000 --store file|redis`.

Builds a cache-manager state of about `--pairs` (worker, block) pairs through the real ingestion path
(BlockStored events of 32 blocks, token ids hashed into index hashes, 50 % shared group prefixes), writes a
snapshot, appends `--log-batches` more batches to the log, then recovers (load + restore + replay) from the
store and checks the recovered index equals the original. Prints one JSON line. With `--store redis` and
no `--redis-url`, a private redis-server is started on a free loopback port and stopped afterwards.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import random
import shutil
import socket
import subprocess
import tempfile
import time
from pathlib import Path

from kvmesh.cachemgr.checkpoint import recover, snapshot_state
from kvmesh.cachemgr.hasher import IndexHasher
from kvmesh.cachemgr.ingest import Ingestor
from kvmesh.core.kvevents import BlockStored, KvEventBatch
from kvmesh.index import PrefixIndex
from kvmesh.ops.warming import PrefixStats
from kvmesh.store.base import CheckpointStore
from kvmesh.store.file import FileCheckpointStore
from kvmesh.wire import ingest_log as codec


class Gen:
    """Synthetic workers storing group-prefix + unique sequences, as KV event batches."""

    def __init__(self, workers: int, block_size: int, seed: int) -> None:
        self.rng = random.Random(seed)
        self.bs = block_size
        self.groups = [[self.rng.randrange(32000) for _ in range(128 * block_size)] for _ in range(32)]
        self.seq = dict.fromkeys((f"w{i}" for i in range(workers)), 0)
        self.has_group: dict[tuple[str, int], int | None] = {}  # (worker, group) → engine hash of last shared block
        self.next_eh = 1

    def _ehs(self, n: int) -> tuple[int, ...]:
        out = tuple(range(self.next_eh, self.next_eh + n))
        self.next_eh += n
        return out

    def batches_for(self, w: str, blocks: int) -> list[KvEventBatch]:
        """Batches of ≤ 32 blocks that add about `blocks` blocks to worker `w`."""
        out: list[KvEventBatch] = []
        while blocks > 0:
            g = self.rng.randrange(32)
            parent = self.has_group.get((w, g))
            if parent is None:
                shared = self.groups[g]
                for i in range(0, 128, 32):
                    ehs = self._ehs(32)
                    out.append(
                        self._batch(
                            w, [BlockStored(ehs, parent, tuple(shared[i * self.bs : (i + 32) * self.bs]), self.bs)]
                        )
                    )
                    parent = ehs[-1]
                self.has_group[(w, g)] = parent
                blocks -= 128
            uniq = min(max(blocks, 1), 128)
            for _ in range(0, uniq, 32):
                k = min(32, uniq)
                ehs = self._ehs(k)
                toks = tuple(self.rng.randrange(32000) for _ in range(k * self.bs))
                out.append(self._batch(w, [BlockStored(ehs, parent, toks, self.bs)]))
                parent = ehs[-1]
                uniq -= k
                blocks -= k
        return out

    def _batch(self, w: str, events: list[BlockStored]) -> KvEventBatch:
        s = self.seq[w]
        self.seq[w] = s + 1
        return KvEventBatch(w, "i0", s, 0.0, tuple(events))


def _start_redis(tmp: Path) -> tuple[subprocess.Popen[bytes], str]:
    import redis

    exe = shutil.which("redis-server")
    if exe is None:
        raise SystemExit("redis-server not installed: run scripts/install_redis.sh")
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    proc = subprocess.Popen(
        [exe, "--port", str(port), "--bind", "127.0.0.1", "--dir", str(tmp), "--save", "", "--appendonly", "no"],
        stdout=subprocess.DEVNULL,
    )
    c = redis.Redis(host="127.0.0.1", port=port, socket_connect_timeout=0.5)
    deadline = time.monotonic() + 20
    while time.monotonic() < deadline:
        try:
            if c.ping():
                return proc, f"redis://127.0.0.1:{port}/0"
        except redis.ConnectionError:
            with contextlib.suppress(subprocess.TimeoutExpired):
                proc.wait(timeout=0.05)
    proc.kill()
    raise SystemExit("redis-server did not answer PING")


async def run(args: argparse.Namespace, store: CheckpointStore) -> dict[str, object]:
    gen = Gen(args.workers, args.block_size, args.seed)
    hasher = IndexHasher("bench")
    idx = PrefixIndex()
    ing = Ingestor(idx, hasher, args.block_size)
    per_worker = args.pairs // args.workers
    t0 = time.perf_counter()
    for w in gen.seq:
        for b in gen.batches_for(w, per_worker):
            ing.apply(b)
    build_s = time.perf_counter() - t0
    t0 = time.perf_counter()
    snap = snapshot_state(idx, ing, PrefixStats())
    await store.save_snapshot(snap)
    save_s = time.perf_counter() - t0
    log = [b for w in list(gen.seq)[: max(1, args.workers // 8)] for b in gen.batches_for(w, args.log_batches * 4)]
    log = log[: args.log_batches]
    recs = [codec.encode_record(codec.LogRecord(codec.BATCH, b.worker_id, batch=b)) for b in log]
    for b in log:
        ing.apply(b)
    for i in range(0, len(recs), 1000):
        await store.append(recs[i : i + 1000])
    pairs = idx.num_pairs()
    rec = await recover(store, hasher, args.block_size)
    assert rec.restored is not None
    ok = rec.restored.index.num_pairs() == pairs and all(
        set(rec.restored.index.blocks_of(w).tolist()) == set(idx.blocks_of(w).tolist()) for w in gen.seq
    )
    total = rec.load_s + rec.restore_s + rec.replay_s
    return {
        "bench": "cachemgr_recovery",
        "store": args.store,
        "pairs": pairs,
        "distinct_blocks": idx.num_entries(),
        "workers": args.workers,
        "block_size": args.block_size,
        "snapshot_bytes": len(snap),
        "log_records": rec.records,
        "build_s": round(build_s, 3),
        "snapshot_save_s": round(save_s, 3),
        "load_s": round(rec.load_s, 3),
        "restore_s": round(rec.restore_s, 3),
        "replay_s": round(rec.replay_s, 3),
        "recovery_s": round(total, 3),
        "recovery_s_per_million_pairs": round(total * 1e6 / pairs, 3),
        "equal": bool(ok),
    }


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--pairs", type=int, default=1_000_000)
    p.add_argument("--workers", type=int, default=64)
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--log-batches", type=int, default=1000)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--store", choices=["file", "redis"], default="file")
    p.add_argument("--redis-url", default="")
    args = p.parse_args(argv)
    with tempfile.TemporaryDirectory(prefix="kvmesh-bench-") as tmp:
        proc = None
        if args.store == "file":
            store: CheckpointStore = FileCheckpointStore(Path(tmp) / "ckpt", fsync_appends=True)
        else:
            from kvmesh.store.redis_store import RedisCheckpointStore

            url = args.redis_url
            if not url:
                proc, url = _start_redis(Path(tmp))
            store = RedisCheckpointStore.from_url(url, prefix=f"bench:{args.seed}")

        async def go() -> dict[str, object]:
            try:
                return await run(args, store)
            finally:
                await store.close()

        try:
            print(json.dumps(asyncio.run(go())))
        finally:
            if proc is not None:
                proc.terminate()
                proc.wait(timeout=10)


if __name__ == "__main__":
    main()
