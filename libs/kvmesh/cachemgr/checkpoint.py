"""Cache-manager state ⇄ checkpoint: snapshot = index snapshot + ingestion state + prefix statistics.

`snapshot_state` captures everything needed to continue exactly: the index (`PrefixIndex.snapshot`),
per worker (instance id, next sequence, phase, engine→index map, buffered batches, retired instances), the
warming statistics and the copies of the followed zones' indexes with their resume points (`zones`, absent
from checkpoints written before zones were followed: those restore with no copies; the format number stays
1). `apply_record` replays one logged input of the ingestion state machine, so `recover` = restore the
snapshot, then replay the log written after it. Workers whose sequence moved on while the cache-manager was
down show up as gaps on their next batch and are resynced as usual. The followed zones' copies are not in
the log: after a restore each resumes from its checkpointed revision (or snapshots).
"""

from __future__ import annotations

import math
import time
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

from kvmesh.cachemgr.enginemap import EngineHashMap
from kvmesh.cachemgr.ingest import Ingestor, Phase, WorkerState
from kvmesh.index import PrefixIndex
from kvmesh.index.types import BlockHasher, IngestResult
from kvmesh.ops.warming.stats import PrefixStats
from kvmesh.replica.index import ReplicaIndex
from kvmesh.store.base import CheckpointStore
from kvmesh.wire import ingest_log as codec

FORMAT = 1


def snapshot_state(
    index: PrefixIndex,
    ingestor: Ingestor,
    stats: PrefixStats | None,
    meta: dict[str, object] | None = None,
    zones: Mapping[str, ReplicaIndex] | None = None,
) -> bytes:
    """Serialise the whole cache-manager state (see module docstring)."""
    workers = [
        [
            st.worker_id,
            st.instance_id,
            st.next_sequence,
            st.phase.value,
            st.hashes.export(),
            [codec.batch_to_wire(b) for b in st.pending.values()],
            st.retired,
            st.skipped_events,
            st.alive_at,
            [list(st.tier_copies.items()), sorted(st.tier_only)],
        ]
        for st in ingestor.workers.values()
    ]
    return codec.encode(
        {
            "format": FORMAT,
            "block_size": ingestor.block_size,
            "index": index.snapshot(),
            "workers": workers,
            "stats": stats.export() if stats is not None else None,
            "meta": meta or {},
            "zones": {z: r.export() for z, r in (zones or {}).items()},
        }
    )


@dataclass(slots=True)
class Restored:
    """The state rebuilt from a snapshot."""

    index: PrefixIndex
    ingestor: Ingestor
    stats: PrefixStats | None
    meta: dict[str, object]
    zones: dict[str, dict[str, Any]] = field(default_factory=dict)  # followed zones' copies (ReplicaIndex.export)


def restore_state(data: bytes, hasher: BlockHasher, max_pending: int = 4096) -> Restored:
    """Inverse of `snapshot_state`."""
    d = codec.decode(data)
    if d.get("format") != FORMAT:
        raise ValueError(f"unsupported checkpoint format {d.get('format')!r}")
    index = PrefixIndex.restore(d["index"])
    ing = Ingestor(index, hasher, int(d["block_size"]), max_pending=max_pending)
    for wid, inst, nxt, phase, hmap, pending, retired, skipped, *rest in d["workers"]:
        alive_at = rest[0] if rest else -math.inf  # snapshots taken before `alive_at` existed have 8 items
        copies, only = rest[1] if len(rest) > 1 else ([], [])  # ... and before media, 9
        batches = [codec.batch_from_wire(b) for b in pending]
        ing.workers[wid] = st = WorkerState(
            wid,
            inst,
            nxt,
            Phase(phase),
            EngineHashMap.restore(hmap),
            {b.sequence: b for b in batches},
            list(retired),
            skipped,
            alive_at,
        )
        st.tier_copies = {int(h): int(n) for h, n in copies}
        st.tier_only = {int(h) for h in only}
    stats = PrefixStats.restore(d["stats"]) if d["stats"] is not None else None
    return Restored(index, ing, stats, dict(d["meta"]), dict(d.get("zones") or {}))


def apply_record(ing: Ingestor, rec: codec.LogRecord) -> IngestResult:
    """Feed one logged input back into the state machine."""
    if rec.kind == codec.BATCH:
        assert rec.batch is not None
        return ing.apply(rec.batch)
    if rec.kind == codec.DUMP_BEGIN:
        return ing.begin_dump(rec.worker_id, rec.instance_id, rec.timestamp)
    if rec.kind == codec.DUMP_EVENTS:
        return ing.apply_dump(rec.worker_id, rec.events)
    if rec.kind == codec.DUMP_END:
        return ing.end_dump(rec.worker_id, rec.next_sequence)
    if rec.kind == codec.REMOVE_WORKER:
        return ing.remove_worker(rec.worker_id)
    if rec.kind == codec.REPLAY_FAILED:
        return ing.replay_failed(rec.worker_id)
    raise ValueError(f"unknown log record kind {rec.kind}")


def replay(ing: Ingestor, records: Iterable[bytes]) -> int:
    """Replay encoded log records in order; returns how many."""
    n = 0
    for raw in records:
        apply_record(ing, codec.decode_record(raw))
        n += 1
    return n


@dataclass(slots=True)
class Recovery:
    """A recovered state and how long each step took."""

    restored: Restored | None
    records: int
    load_s: float
    restore_s: float
    replay_s: float


async def recover(store: CheckpointStore, hasher: BlockHasher, block_size: int) -> Recovery:
    """Load snapshot + log from `store`, restore, replay. No snapshot yet: an empty state + the log."""
    t0 = time.perf_counter()
    loaded = await store.load()
    t1 = time.perf_counter()
    if loaded.snapshot is not None:
        restored = restore_state(loaded.snapshot, hasher)
    else:
        idx = PrefixIndex()
        restored = Restored(idx, Ingestor(idx, hasher, block_size), None, {})
    t2 = time.perf_counter()
    n = replay(restored.ingestor, loaded.records)
    t3 = time.perf_counter()
    return Recovery(restored, n, t1 - t0, t2 - t1, t3 - t2)
