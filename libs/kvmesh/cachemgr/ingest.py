"""Ingestion state machine: per-worker KV event batches → prefix index, with gap/restart detection.

Pure: no sockets, no clock. The transport (gRPC stream from kvmesh workers, ZMQ from stock vLLM) feeds
`KvEventBatch`es and dump markers and turns `ResyncRequest`s into replay or full-dump requests.

Per worker the state is (instance_id, next expected sequence, phase, engine→index hash map):

* `seq == next`: apply, `next += 1`, then drain buffered batches that have become contiguous.
* `seq < next`: duplicate or old (a replay overlapping what was seen) → ignored.
* `seq > next` (gap): phase REPLAYING, the batch is buffered (bounded) and a replay from `next` is
  requested. The worker's entries stay as they were at `next - 1` (lagging, never wrong) and nothing past
  the gap is applied until the gap is filled.
* A batch of an instance this worker already replaced (late delivery) is ignored, and so is a batch of an
  unknown instance stamped earlier than the current instance's latest batch or dump (`alive_at`): one
  engine runs per worker at a time, so an earlier incarnation's batches all precede the current one's
  (engines stamp batches with the wall clock, as vLLM and kvmesh workers do). Without that order, a late
  batch of an incarnation that was never seen would pass for a restart and retire the live instance.
* A different, new `instance_id` (worker restart): the engine's cache is gone, so the worker's entries are
  dropped, `next = 0`, and the batch is handled under the new instance (a gap from 0 asks for a replay).
* The replay cannot fill the gap (`replay_failed`), the buffer overflows, or an event cannot be applied
  (a parent unknown, an engine hash mapped to two index hashes): the worker's entries are dropped and a
  full dump is requested (phase DUMP_NEEDED). `begin_dump` / `apply_dump` / `end_dump(next_sequence)`
  rebuild the worker from a dump taken at `next_sequence - 1`; live batches that arrive meanwhile are
  buffered and drained after `end_dump`. Dump events have set semantics (no copy counting): a held block
  whose ancestors are not held is dumped as a `BlockStored` of the whole chain from the root followed by a
  `BlockRemoved` of the ancestors that are not held (a block held on the GPU and in a host tier is dumped
  once per medium: two copies); a dumped block whose parent is neither held nor dumped (a worker's mirror
  keeps a block whose parent it evicted) is skipped, as are its descendants: no prefix reaches them. While a
  dump is needed, a batch that contains
  `AllBlocksCleared` (an engine cache reset, e.g. requested by the transport of an engine that cannot
  dump) is a resync point too: the worker's state after it is fully known, so ingestion resumes there.
  Live, `AllBlocksCleared` clears the engine's pool only: blocks the worker also holds in a host tier stay
  in the index, now tier-only.

Index hashes of `BlockStored` blocks are derived from the token ids, chained after the parent's index hash
(found through the engine→index map), so the index never depends on an engine's private hash seed. A root
block (no parent) is salted with `make_salt(model, lora, tenant)` of its event; a child inherits its
chain's tenant through the parent's index hash (the salt enters a chain at its root only), so an event
continuing a chain needs no tenant and cannot move a chain to another tenant.

Media. Events carry the medium a block is stored in ("GPU" for the engine's pool, None read as GPU;
"CPU"/"DISK" for a worker's host tiers). The index holds every (worker, block) whatever its medium (a
worker can load a tier block); beside it, per worker, a side map counts the non-GPU copies of each block
and keeps the set of blocks the worker holds *only* in a tier (`tier_only`, small: a tier block that is
also on the GPU is not in it). `gpu_run(worker, hashes, matched)` splits a match into its leading GPU run
and the rest (loadable from the worker's tiers; `kvmesh.replica.media`). Every event that changes a block's
tier-only state adds one `Media` delta after its Stored/Removed ones (blocks now tier-only, blocks back on the
GPU), so a watching replica keeps the same set.
"""

from __future__ import annotations

import enum
import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field

from kvmesh.cachemgr.enginemap import EngineHashMap
from kvmesh.core.kvevents import AllBlocksCleared, BlockRemoved, BlockStored, KvEvent, KvEventBatch, is_tier
from kvmesh.index.types import (
    BlockHasher,
    Cleared,
    IndexWriter,
    IngestResult,
    Media,
    Removed,
    ResyncRequest,
    Stored,
)
from kvmesh.replica import media

MASK64 = (1 << 64) - 1
RETIRED_KEEP = 8  # instance ids of earlier incarnations remembered per worker (late batches ignored)


class Phase(enum.Enum):
    """Sync phase of one worker."""

    SYNCED = "synced"
    REPLAYING = "replaying"
    DUMP_NEEDED = "dump_needed"
    DUMPING = "dumping"


class InconsistentEvent(Exception):
    """An event that cannot be applied without guessing (unknown parent, conflicting hashes)."""


@dataclass(slots=True)
class WorkerState:
    """Ingestion state of one worker."""

    worker_id: str
    instance_id: str
    next_sequence: int = 0
    phase: Phase = Phase.SYNCED
    hashes: EngineHashMap = field(default_factory=EngineHashMap)
    pending: dict[int, KvEventBatch] = field(default_factory=dict)
    retired: list[str] = field(default_factory=list)
    skipped_events: int = 0
    alive_at: float = -math.inf  # latest timestamp of the current instance (its batches and dumps)
    tier_copies: dict[int, int] = field(default_factory=dict)  # index hash -> copies in a host tier
    tier_only: set[int] = field(default_factory=set)  # index hashes held in a host tier and not on the GPU
    moved: dict[int, bool] = field(default_factory=dict)  # this event's tier_only changes: hash -> was in it


@dataclass(slots=True)
class IngestCounters:
    """Monotonic counters for metrics."""

    batches: int = 0
    events: int = 0
    gaps: int = 0
    restarts: int = 0
    resyncs_full: int = 0
    duplicates: int = 0


class Ingestor:
    """Applies KV event batches of many workers to one prefix index (see module docstring)."""

    def __init__(self, index: IndexWriter, hasher: BlockHasher, block_size: int, max_pending: int = 4096) -> None:
        self.index = index
        self.hasher = hasher
        self.block_size = block_size
        self.max_pending = max_pending
        self.workers: dict[str, WorkerState] = {}
        self.counters = IngestCounters()

    # ---------------------------------------------------------------- live batches
    def apply(self, batch: KvEventBatch) -> IngestResult:
        """Feed one live (or replayed) batch; see the module docstring for the transitions."""
        res = IngestResult()
        st = self.workers.get(batch.worker_id)
        if st is None:
            st = self.workers[batch.worker_id] = WorkerState(batch.worker_id, batch.instance_id)
        elif st.instance_id != batch.instance_id:
            if batch.instance_id in st.retired or batch.timestamp < st.alive_at:
                self.counters.duplicates += 1
                res.ignored.append((batch.sequence, "retired instance"))
                if batch.instance_id not in st.retired:
                    self._retire(st, batch.instance_id)
                return res
            self._restart(st, batch.instance_id, res)
        st.alive_at = max(st.alive_at, batch.timestamp)
        seq = batch.sequence
        if seq < st.next_sequence:
            self.counters.duplicates += 1
            res.ignored.append((seq, "duplicate"))
            return res
        if st.phase is Phase.DUMP_NEEDED and any(isinstance(e, AllBlocksCleared) for e in batch.events):
            # the engine emptied its cache: the state after this batch is known without a dump
            st.phase = Phase.SYNCED
            st.next_sequence = seq
            for s in [s for s in st.pending if s <= seq]:
                del st.pending[s]
        if st.phase in (Phase.DUMP_NEEDED, Phase.DUMPING) or seq > st.next_sequence:
            return self._buffer(st, batch, res)
        self._apply_in_order(st, batch, res)
        return res

    def replay_failed(self, worker_id: str, reason: str = "replay incomplete") -> IngestResult:
        """The transport could not replay from `next_sequence`: escalate to a full dump."""
        res = IngestResult()
        st = self.workers.get(worker_id)
        if st is not None and st.phase is Phase.REPLAYING:
            self._need_dump(st, reason, res)
        return res

    # ---------------------------------------------------------------- full dumps
    def begin_dump(self, worker_id: str, instance_id: str, timestamp: float = -math.inf) -> IngestResult:
        """A full dump (taken at the worker's `timestamp`) starts: the worker's entries are dropped and rebuilt
        from the dump's events."""
        res = IngestResult()
        st = self.workers.get(worker_id)
        if st is None:
            st = self.workers[worker_id] = WorkerState(worker_id, instance_id)
        elif st.instance_id != instance_id:
            self._restart(st, instance_id, res)
        st.alive_at = max(st.alive_at, timestamp)
        self._drop_entries(st, res)
        st.phase = Phase.DUMPING
        return res

    def apply_dump(self, worker_id: str, events: Iterable[KvEvent]) -> IngestResult:
        """Events of an ongoing dump (normally only `BlockStored`, parents before children)."""
        res = IngestResult()
        st = self.workers.get(worker_id)
        if st is None or st.phase is not Phase.DUMPING:
            res.ignored.append((-1, "dump events outside a dump"))
            return res
        try:
            for ev in events:
                self._apply_event(st, ev, res, dump=True)
        except InconsistentEvent as exc:
            self._need_dump(st, f"inconsistent dump: {exc}", res)
        return res

    def end_dump(self, worker_id: str, next_sequence: int) -> IngestResult:
        """The dump reflects the worker up to `next_sequence - 1`; live batches resume at `next_sequence`."""
        res = IngestResult()
        st = self.workers.get(worker_id)
        if st is None or st.phase is not Phase.DUMPING:
            res.ignored.append((next_sequence, "dump end outside a dump"))
            return res
        st.phase = Phase.SYNCED
        st.next_sequence = next_sequence
        for s in [s for s in st.pending if s < next_sequence]:
            del st.pending[s]
        self._drain(st, res)
        return res

    # ---------------------------------------------------------------- queries
    def pending_resyncs(self) -> list[ResyncRequest]:
        """Resyncs still outstanding (for the transport to re-issue after a timeout or a recovery)."""
        out = []
        for st in self.workers.values():
            if st.phase is Phase.REPLAYING:
                out.append(ResyncRequest(st.worker_id, st.instance_id, st.next_sequence, False, "gap"))
            elif st.phase is Phase.DUMP_NEEDED:
                out.append(ResyncRequest(st.worker_id, st.instance_id, st.next_sequence, True, "dump"))
        return out

    def is_replaying(self, worker_id: str) -> bool:
        """True while a gap of this worker waits to be filled by a replay."""
        st = self.workers.get(worker_id)
        return st is not None and st.phase is Phase.REPLAYING

    def gpu_run(self, worker_id: str, hashes: Sequence[int], matched: int) -> int:
        """How many of the `matched` leading `hashes` of a worker's match are on its GPU (the rest: tiers;
        `kvmesh.replica.media.gpu_run`)."""
        st = self.workers.get(worker_id)
        return matched if st is None else media.gpu_run(hashes, matched, st.tier_only)

    def tier_only_of(self, worker_id: str) -> frozenset[int]:
        """The blocks the worker holds only in a host tier (for a watch snapshot)."""
        st = self.workers.get(worker_id)
        return frozenset(st.tier_only) if st is not None else frozenset()

    def remove_worker(self, worker_id: str) -> IngestResult:
        """A worker left the fleet: forget its state and its entries."""
        res = IngestResult()
        st = self.workers.pop(worker_id, None)
        if st is not None:
            self._drop_entries(st, res)
        return res

    # ---------------------------------------------------------------- internals
    def _restart(self, st: WorkerState, instance_id: str, res: IngestResult) -> None:
        self.counters.restarts += 1
        res.restart = True
        self._drop_entries(st, res)
        self._retire(st, st.instance_id)
        st.instance_id = instance_id
        st.next_sequence = 0
        st.phase = Phase.SYNCED
        st.pending.clear()

    @staticmethod
    def _retire(st: WorkerState, instance_id: str) -> None:
        st.retired = [*st.retired[-(RETIRED_KEEP - 1) :], instance_id]

    def _buffer(self, st: WorkerState, batch: KvEventBatch, res: IngestResult) -> IngestResult:
        if st.phase is Phase.SYNCED:
            self.counters.gaps += 1
            res.gap = True
            st.phase = Phase.REPLAYING
            res.resync = ResyncRequest(
                st.worker_id,
                st.instance_id,
                st.next_sequence,
                False,
                f"gap: expected {st.next_sequence}, got {batch.sequence}",
            )
        st.pending[batch.sequence] = batch
        res.buffered.append(batch.sequence)
        if len(st.pending) > self.max_pending:
            st.pending.clear()
            self._need_dump(st, "replay buffer overflow", res)
        return res

    def _apply_in_order(self, st: WorkerState, batch: KvEventBatch, res: IngestResult) -> None:
        self._apply_batch(st, batch, res)
        if st.phase is Phase.SYNCED or st.phase is Phase.REPLAYING:
            self._drain(st, res)

    def _drain(self, st: WorkerState, res: IngestResult) -> None:
        while st.phase in (Phase.SYNCED, Phase.REPLAYING) and st.next_sequence in st.pending:
            self._apply_batch(st, st.pending.pop(st.next_sequence), res)
        if st.phase is Phase.REPLAYING and not st.pending:
            st.phase = Phase.SYNCED
        elif st.phase is Phase.SYNCED and st.pending:
            st.phase = Phase.REPLAYING
            res.resync = ResyncRequest(st.worker_id, st.instance_id, st.next_sequence, False, "gap")

    def _apply_batch(self, st: WorkerState, batch: KvEventBatch, res: IngestResult) -> None:
        self.counters.batches += 1
        try:
            for ev in batch.events:
                self._apply_event(st, ev, res)
        except InconsistentEvent as exc:
            st.pending.clear()
            self._need_dump(st, f"inconsistent batch {batch.sequence}: {exc}", res)
            st.next_sequence = batch.sequence + 1
            return
        st.next_sequence = batch.sequence + 1
        res.applied.append(batch.sequence)

    def _apply_event(self, st: WorkerState, ev: KvEvent, res: IngestResult, dump: bool = False) -> None:
        self.counters.events += 1
        try:
            self._apply_one(st, ev, res, dump)
        finally:
            self._flush_media(st, res)

    @staticmethod
    def _flush_media(st: WorkerState, res: IngestResult) -> None:
        """One `Media` delta for the blocks whose tier-only state this event changed (after its Stored/Removed)."""
        if not st.moved:
            return
        only = st.tier_only
        tier = tuple(h for h, was in st.moved.items() if not was and h in only)
        gpu = tuple(h for h, was in st.moved.items() if was and h not in only)
        st.moved.clear()
        if tier or gpu:
            res.deltas.append(Media(st.worker_id, tier, gpu))

    def _apply_one(self, st: WorkerState, ev: KvEvent, res: IngestResult, dump: bool) -> None:
        if isinstance(ev, BlockStored):
            self._stored(st, ev, res, dump)
        elif isinstance(ev, BlockRemoved):
            m = st.hashes
            tier = is_tier(ev.medium)
            gone: list[int] = []
            for eh in ev.block_hashes:
                eh &= MASK64
                held = m.live.get(eh)
                ih = m.drop(eh, dump)
                if ih is not None:
                    gone.append(ih)
                if held is not None and (tier or held in st.tier_copies):
                    self._tier_copy(st, eh, held, -1 if tier else 0)
            if gone:
                self.index.remove(st.worker_id, gone)
                res.deltas.append(Removed(st.worker_id, tuple(gone)))
        elif isinstance(ev, AllBlocksCleared):
            self._pool_cleared(st, res)

    def _stored(self, st: WorkerState, ev: BlockStored, res: IngestResult, dump: bool) -> None:
        n = len(ev.block_hashes)
        if n == 0:
            return
        if ev.block_size != self.block_size or len(ev.token_ids) != n * ev.block_size:
            st.skipped_events += 1  # partial / other-granularity blocks are not prefix-indexable here
            return
        parent: int | None = None
        if ev.parent_block_hash is not None:
            parent = st.hashes.parent(ev.parent_block_hash & MASK64)
            if parent is None:
                if dump:  # kept after its parent's eviction (a worker's mirror): no chain to put it on, and no
                    st.skipped_events += 1  # prefix reaches it; refusing it would refuse every later dump too
                    return
                raise InconsistentEvent(f"unknown parent block {ev.parent_block_hash:#x}")
        ihs = self.hasher.chain(parent, ev.token_ids, ev.block_size, ev.lora_name, ev.tenant)
        new_run: list[int] = []
        run_parent = prev = parent
        tier = is_tier(ev.medium)
        for eh, ih in zip(ev.block_hashes, ihs, strict=True):
            # a dump has set semantics per medium: a block dumped on the GPU and in a tier is two copies
            added = st.hashes.add(eh & MASK64, ih, count=not dump or tier != (ih in st.tier_copies))
            if added is None:
                raise InconsistentEvent(f"engine block {eh:#x} maps to two index hashes")
            if tier or ih in st.tier_copies:
                self._tier_copy(st, eh & MASK64, ih, (0 if dump and ih in st.tier_copies else 1) if tier else 0)
            if added:
                if not new_run:
                    run_parent = prev
                new_run.append(ih)
            elif new_run:  # an already-held block splits the stored runs; each run keeps its own parent
                self._store(st, run_parent, new_run, res)
                new_run = []
            prev = ih
        if new_run:
            self._store(st, run_parent, new_run, res)

    def _store(self, st: WorkerState, parent: int | None, hashes: list[int], res: IngestResult) -> None:
        self.index.store(st.worker_id, parent, hashes)
        res.deltas.append(Stored(st.worker_id, parent, tuple(hashes)))

    @staticmethod
    def _tier_copy(st: WorkerState, eh: int, ih: int, delta: int) -> None:
        """Count `delta` tier copies of a block and re-derive whether the worker holds it only in a tier."""
        n = st.tier_copies.get(ih, 0) + delta
        live = st.hashes.live.get(eh) == ih
        total = st.hashes.extra.get(eh, 1) if live else 0  # copies of any medium
        st.moved.setdefault(ih, ih in st.tier_only)
        if not live or n <= 0:
            st.tier_copies.pop(ih, None)
            st.tier_only.discard(ih)
            return
        st.tier_copies[ih] = n
        if n >= total:
            st.tier_only.add(ih)
        else:
            st.tier_only.discard(ih)

    def _pool_cleared(self, st: WorkerState, res: IngestResult) -> None:
        """`AllBlocksCleared`: the engine reset its own pool (vLLM's event names no medium and means its
        pool); the worker's host tiers keep their blocks, which become tier-only. The rest go."""
        if not st.tier_copies:
            self._drop_entries(st, res)
            return
        m = st.hashes
        gone: list[int] = []
        for eh, ih in list(m.live.items()):
            n = st.tier_copies.get(ih, 0)
            if n <= 0:
                m.drop(eh, all_copies=True)
                gone.append(ih)
                continue
            if n > 1:
                m.extra[eh] = n
            else:
                m.extra.pop(eh, None)
            st.moved.setdefault(ih, ih in st.tier_only)
            st.tier_only.add(ih)
        if gone:
            self.index.remove(st.worker_id, gone)
            res.deltas.append(Removed(st.worker_id, tuple(gone)))

    def _drop_entries(self, st: WorkerState, res: IngestResult) -> None:
        self.index.clear(st.worker_id)
        st.hashes.clear()
        st.tier_copies.clear()
        st.tier_only.clear()
        st.moved.clear()  # Cleared drops the replica's tier-only set too
        res.deltas.append(Cleared(st.worker_id))

    def _need_dump(self, st: WorkerState, reason: str, res: IngestResult) -> None:
        self.counters.resyncs_full += 1
        self._drop_entries(st, res)
        st.phase = Phase.DUMP_NEEDED
        res.resync = ResyncRequest(st.worker_id, st.instance_id, st.next_sequence, True, reason)
