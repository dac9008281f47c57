"""The cache-manager's state and operations, free of gRPC: ingestion, queries, watch, checkpoints.

Every input of the ingestion state machine is applied, appended to the pending log, fanned out as
index deltas; `persist()` makes the pending log durable (the servicer acknowledges a batch only after
it). `checkpoint()` snapshots the state and starts a new log epoch (see `kvmesh.store.base`).
Hit ratio = Σ max-matched blocks / Σ queried blocks over all queries since start: `find_matches` calls and
the prompts routers report having routed from their index replicas (`count_query`).

Every revision's deltas also go to the journal (`kvmesh.cachemgr.journal`), so a watcher can `resume` from
its last revision; `epoch` names this run's revision numbering (new at start and at every restore). `zones`
holds the copies of the followed zones' indexes (`ReplicaIndex`, kept by their followers), apart from the
local index: they are checkpointed with it and restored in place.
"""

from __future__ import annotations

import asyncio
import math
import time
import uuid
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass

from kvmesh.cachemgr.checkpoint import Recovery, recover, snapshot_state
from kvmesh.cachemgr.fanout import FanOut, Watcher
from kvmesh.cachemgr.hasher import IndexHasher
from kvmesh.cachemgr.ingest import Ingestor
from kvmesh.cachemgr.journal import DeltaJournal, Entry
from kvmesh.core.kvevents import KvEvent, KvEventBatch
from kvmesh.index import PrefixIndex
from kvmesh.index.types import IngestResult, Media, Stored
from kvmesh.ops.warming import PrefixStats
from kvmesh.ops.warming.stats import checkpoint_keys
from kvmesh.replica.index import ReplicaIndex
from kvmesh.store.base import CheckpointStore
from kvmesh.wire import ingest_log as codec


@dataclass(slots=True)
class QueryCounters:
    """Totals of the queries counted (`CacheCore.count_query`)."""

    queries: int = 0
    blocks_queried: int = 0
    blocks_hit: int = 0

    @property
    def hit_ratio(self) -> float:
        return self.blocks_hit / self.blocks_queried if self.blocks_queried else 0.0


class CacheCore:
    """See module docstring."""

    def __init__(
        self,
        block_size: int,
        model: str,
        store: CheckpointStore | None = None,
        window_s: float = 60.0,
        journal_revisions: int = 4096,
        zones: Sequence[str] = (),
    ) -> None:
        self.block_size = block_size
        self.model = model
        self.hasher = IndexHasher(model)
        self.store = store
        self.index = PrefixIndex()
        self.ingestor = Ingestor(self.index, self.hasher, block_size)
        self.stats = PrefixStats(window_s=window_s)
        self.fanout = FanOut()
        self.revision = 0
        self.journal = DeltaJournal(journal_revisions, new_epoch())
        self.zones: dict[str, ReplicaIndex] = {z: ReplicaIndex() for z in zones}
        self.queries = QueryCounters()
        self._pending: list[bytes] = []
        self._store_lock = asyncio.Lock()
        self.log_broken = False  # an append or snapshot failed: no appends until a checkpoint succeeds
        self._hashers: dict[tuple[str, str | None], IndexHasher] = {}
        self.on_observe: Callable[[Sequence[int], float], None] | None = None  # e.g. warm-set accesses

    # ------------------------------------------------------------ ingestion
    def _record(self, rec: codec.LogRecord, res: IngestResult) -> IngestResult:
        if self.store is not None:
            self._pending.append(codec.encode_record(rec))
        if res.deltas:
            self.revision += 1
            entry = Entry(self.revision, time.time(), tuple(res.deltas))
            self.journal.append(entry)
            self.fanout.publish(entry)
        return res

    def apply(self, batch: KvEventBatch) -> IngestResult:
        """A live batch."""
        return self._record(codec.LogRecord(codec.BATCH, batch.worker_id, batch=batch), self.ingestor.apply(batch))

    def begin_dump(self, worker_id: str, instance_id: str, timestamp: float = -math.inf) -> IngestResult:
        return self._record(
            codec.LogRecord(codec.DUMP_BEGIN, worker_id, instance_id=instance_id, timestamp=timestamp),
            self.ingestor.begin_dump(worker_id, instance_id, timestamp),
        )

    def apply_dump(self, worker_id: str, events: Sequence[KvEvent]) -> IngestResult:
        return self._record(
            codec.LogRecord(codec.DUMP_EVENTS, worker_id, events=tuple(events)),
            self.ingestor.apply_dump(worker_id, events),
        )

    def end_dump(self, worker_id: str, next_sequence: int) -> IngestResult:
        return self._record(
            codec.LogRecord(codec.DUMP_END, worker_id, next_sequence=next_sequence),
            self.ingestor.end_dump(worker_id, next_sequence),
        )

    def replay_failed(self, worker_id: str, reason: str = "replay incomplete") -> IngestResult:
        return self._record(
            codec.LogRecord(codec.REPLAY_FAILED, worker_id), self.ingestor.replay_failed(worker_id, reason)
        )

    def is_replaying(self, worker_id: str) -> bool:
        return self.ingestor.is_replaying(worker_id)

    def remove_worker(self, worker_id: str) -> IngestResult:
        res = self._record(codec.LogRecord(codec.REMOVE_WORKER, worker_id), self.ingestor.remove_worker(worker_id))
        self.index.remove_worker(worker_id)
        return res

    async def persist(self) -> None:
        """Append the pending log records to the store (in order).

        After an append fails (the store full or gone: its error is raised) the log has a hole where those
        records were: nothing more is appended until a checkpoint succeeds, since a record after a missing
        one would replay onto the wrong state; the checkpoint's snapshot holds everything and starts a new
        log. Until then a restore gives the state up to the hole, which the workers' resync brings up to
        date."""
        if self.store is None or not self._pending:
            return
        async with self._store_lock:
            recs, self._pending = self._pending, []
            if recs and not self.log_broken:
                try:
                    await self.store.append(recs)
                except Exception:
                    self.log_broken = True
                    raise

    # ------------------------------------------------------------ queries
    def hasher_for(self, model: str, lora: str | None, tenant: str | None) -> tuple[IndexHasher, str | None]:
        """Hasher of (model, tenant) and the lora name to chain with."""
        key = (model or self.model, tenant or None)
        h = self._hashers.get(key)
        if h is None:
            h = self._hashers[key] = IndexHasher(key[0], tenant=key[1])
        return h, lora or None

    def hashes_of(
        self, token_ids: Sequence[int], model: str = "", lora: str | None = None, tenant: str | None = None
    ) -> list[int]:
        h, lo = self.hasher_for(model, lora, tenant)
        return h.chain(None, token_ids, self.block_size, lo)

    def find_matches(
        self, hashes: Sequence[int], now: float, token_ids: Sequence[int] | None = None, tenant: str | None = None
    ) -> dict[str, int]:
        """Matches, counted as a query (`count_query`)."""
        m = self.index.find_matches(hashes)
        self.count_query(len(hashes), checkpoint_keys(hashes), max(m.values(), default=0), now, token_ids, tenant)
        return m

    def count_query(
        self,
        n_blocks: int,
        keys: Sequence[int],
        hit_blocks: int,
        now: float,
        token_ids: Sequence[int] | None = None,
        tenant: str | None = None,
    ) -> None:
        """One query of `n_blocks` blocks (its checkpoint `keys`), `hit_blocks` of them on its best worker:
        counted in the hit ratio and the prefix statistics (`on_observe` sees the keys). FindMatches queries
        and the prompts routers report (ReportRoutedPrefixes) are counted here alike."""
        self.queries.queries += 1
        self.queries.blocks_queried += n_blocks
        self.queries.blocks_hit += hit_blocks
        seen = self.stats.observe_keys(n_blocks, keys, now, token_ids, self.block_size, tenant)
        if self.on_observe is not None:
            self.on_observe(seen, now)

    def tier_blocks(self, hashes: Sequence[int], matches: dict[str, int]) -> dict[str, int]:
        """Per worker, how many blocks of its match it holds only in its host tiers (CPU/disk), not on GPU."""
        return {w: n - self.ingestor.gpu_run(w, hashes, n) for w, n in matches.items()}

    # ------------------------------------------------------------ watch
    def watch(self, workers: Iterable[str]) -> tuple[Watcher, int, list[tuple[Stored, Media]]]:
        """Register a watcher and return it with a consistent snapshot (same event-loop step): per worker its
        blocks and those of them it holds only in a host tier."""
        ws = frozenset(workers)
        watcher = self.fanout.add(ws)
        snap = [
            (
                Stored(w, None, tuple(self.index.blocks_of(w).tolist())),
                Media(w, tuple(self.ingestor.tier_only_of(w))),
            )
            for w in self.index.workers()
            if not ws or w in ws
        ]
        return watcher, self.revision, snap

    def resume(self, workers: Iterable[str], epoch: str, revision: int) -> tuple[Watcher, list[Entry]] | None:
        """Register a watcher and return it with the entries after `revision` of `epoch` (its workers' deltas),
        or None (nothing registered) when the journal cannot tell them all: the caller sends a snapshot."""
        missed = self.journal.since(epoch, revision)
        if missed is None:
            return None
        ws = frozenset(workers)
        entries = [e for e in (x.for_workers(ws) for x in missed) if e is not None]
        return self.fanout.add(ws), entries

    # ------------------------------------------------------------ checkpoints
    async def checkpoint(self) -> tuple[int, int]:
        """Snapshot now; returns (pairs, bytes)."""
        if self.store is None:
            raise RuntimeError("no checkpoint store configured")
        async with self._store_lock:
            meta: dict[str, object] = {"revision": self.revision, "time": time.time()}
            snap = snapshot_state(self.index, self.ingestor, self.stats, meta, self.zones)
            self._pending.clear()  # everything pending is inside the snapshot
            try:
                await self.store.save_snapshot(snap)
            except Exception:
                self.log_broken = True  # the cleared records are in no log: see `persist`
                raise
            self.log_broken = False
        return self.index.num_pairs(), len(snap)

    async def restore(self) -> Recovery:
        """Replace the state with the store's snapshot + log (watchers are dropped: they re-subscribe)."""
        if self.store is None:
            raise RuntimeError("no checkpoint store configured")
        async with self._store_lock:
            rec = await recover(self.store, self.hasher, self.block_size)
            self._pending.clear()
            self.log_broken = False  # the state is the store's again: its log continues it
        assert rec.restored is not None
        self.index = rec.restored.index
        self.ingestor = rec.restored.ingestor
        if rec.restored.stats is not None:
            self.stats = rec.restored.stats
        self.revision = int(rec.restored.meta.get("revision", 0)) + rec.records  # type: ignore[call-overload]
        self.journal.reset(new_epoch(), self.revision)  # the old revisions no longer describe the index
        for z, replica in self.zones.items():  # in place: the zones' followers keep their copies
            replica.load(rec.restored.zones.get(z))
        for w in list(self.fanout.watchers):
            self.fanout.remove(w)
            w.queue.put_nowait(None)
        return rec


def new_epoch() -> str:
    """A fresh epoch id (random: two runs of a cache-manager never share one)."""
    return uuid.uuid4().hex[:16]
