"""`KvmeshConnector`: vLLM's KV connector (v1 API) over kvmesh's kv-sync tier regions.

Loaded by vLLM from `--kv-transfer-config`::

    {"kv_connector": "KvmeshConnector", "kv_connector_module_path": "kvmesh.kvplane.vllm_connector.connector",
     "kv_role": "kv_both", "kv_load_failure_policy": "recompute",
     "kv_connector_extra_config": {"shm_name": "kvmesh-tier-w1", "tier_bytes": 268435456,
                                   "load_async": true, "save_async": true, "io_nice": 0}}

- Scheduler side (`get_num_new_matched_tokens`): claims the leading blocks beyond vLLM's own prefix
  hit that the worker's own tier (a `RegionReader` on its own region) or the peer named in the request's
  `kv_transfer_params["kvmesh_pull"]` holds. Lookups are one-sided scans of shared-memory headers: no
  network call, nothing that blocks the scheduler loop.
- Loads are asynchronous (`load_async`, the default): the claim is returned as `(tokens, True)`, vLLM
  allocates the blocks and parks the request in WAITING_FOR_REMOTE_KVS, and the worker side copies the
  blocks on its tier I/O thread while the engine keeps stepping the running requests; `get_finished` reports
  the request once its copies ended, and vLLM schedules it from there. With `load_async: false` the blocks
  are copied inside the step, before its forward (every running stream waits for them).
- Every copy in is verified (generation, identity, CRC32C). A block that fails (StaleBlock, CorruptBlock, a
  region gone, a peer's lease that ended before its copy could start) fails the load closed: it and every
  block after it are reported by `get_block_ids_with_load_errors` (for an asynchronous load no later than
  the step that reports the request finished), so vLLM recomputes from the first failed block
  (`kv_load_failure_policy: recompute`). A request whose load failed is never claimed again. A block pulled
  from a peer is also kept in the own tier.
- Saves (`save_async`, the default): `wait_for_save` hands the full blocks (prompt or generated) the step
  computed to the I/O thread, which copies each out of the KV cache straight into a reserved slot of the own
  tier (`TierRegion.reserve` / `publish`; on an accelerator through a pinned staging block on a side stream
  that first waits for an event recorded after the step's forward: no host sync) and publishes it. Until
  then the block is simply not offered. Its KV cache memory must outlive the copy: a request with saves is
  finished by vLLM with its blocks held (`request_finished` -> True) until `get_finished` reports its saves
  done (`finished_sending`), and `handle_preemptions` waits for a preempted request's pending saves before
  the step reuses its blocks. With `save_async: false` `wait_for_save` waits for the step's saves.
- Tier I/O (loads, saves, the own region, readers of peers' regions) all runs on one thread
  (`_TierIo`): the region is single-writer, and a synchronous load is a job the step waits for. Loads are
  copied into the KV cache a staging chunk at a time (one `index_copy_` per layer), so the thread takes
  the GIL back from the engine's thread a few times per chunk, not per block and layer. With asynchronous
  loads the thread may run at a higher nice value (`io_nice`, default 0: see `DEFAULT_IO_NICE`).
- Tier events (`events.py`): when vLLM publishes KV events, each block the worker side puts in (or the tier
  evicts from) its own tier comes back in the step's connector output as `BlockStored` / `BlockRemoved`
  with medium "CPU" under vLLM's own block hashes, only once published; `take_events` hands them to vLLM's
  publisher.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import os
import threading
import time
from collections import Counter, defaultdict, deque
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, TypeVar

import torch
from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorMetadata,
    KVConnectorRole,
)
from vllm.distributed.kv_transfer.kv_connector.v1.metrics import KVConnectorStats

from kvmesh.core.errors import FailedPrecondition, KvmeshError
from kvmesh.kvplane.kvsync.tier import (
    SHM_DIR,
    RegionReader,
    SlotRef,
    TierRegion,
    checksum,
    copy_checksum,
    region_name,
)
from kvmesh.kvplane.vllm_connector.blocks import PagedKv, UnsupportedLayout, byte_tensor
from kvmesh.kvplane.vllm_connector.events import KvmeshKVEvents, TierEventLog, block_key
from kvmesh.kvplane.vllm_connector.layout import (
    KvLayout,
    block_salt,
    layout_from_vllm,
    shard_region_name,
)
from kvmesh.kvplane.vllm_connector.plan import (
    OWN,
    ConnectorMetadata,
    LoadOp,
    RequestTracker,
    SaveOp,
    SlotLike,
    lease_covers,
    lease_usable,
    loadable_blocks,
    offered,
    parse_pull,
    plan_loads,
)
from kvmesh.kvplane.vllm_connector.plugin import request_amx_permission

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.distributed.kv_events import KVCacheEvent
    from vllm.forward_context import ForwardContext
    from vllm.v1.attention.backend import AttentionMetadata
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.kv_cache_interface import KVCacheConfig
    from vllm.v1.outputs import KVConnectorOutput
    from vllm.v1.request import Request

log = logging.getLogger(__name__)
_Op = TypeVar("_Op", LoadOp, SaveOp)
DEFAULT_TIER_BYTES = 256 << 20
# what a failed load can raise: the tier's own (StaleBlock, CorruptBlock, NotFound, a foreign format), the OS's
LOAD_ERRORS = (KvmeshError, OSError, ValueError, IndexError)
SHUTDOWN_WAIT_S = 30.0  # longest `shutdown` waits for the tier I/O thread's queued copies
LOAD_CHUNK_BYTES = 16 << 20  # the loads' staging chunk: blocks copied into the KV cache together
LOAD_CHUNK_BLOCKS = 128  # at most (small blocks: the chunk's bookkeeping, not its bytes, is the cost)
# The tier I/O thread's nice value. Above 0 a background copy yields the CPU to the engine's threads, but
# a thread that is descheduled while it holds the GIL (between two copies) keeps the engine's thread
# waiting until it runs again: at nice 19 on a busy machine that made rarer but longer stalls (a worse
# p99) than sharing the CPU at the engine's priority. Raise it where cores are spare.
DEFAULT_IO_NICE = 0


def _flag(extra: Mapping[str, Any], key: str, default: bool) -> bool:
    """A boolean extra-config key (JSON true/false; a string must say true or false)."""
    value = extra.get(key, default)
    if isinstance(value, bool):
        return value
    if isinstance(value, str) and value.lower() in ("true", "false"):
        return value.lower() == "true"
    raise ValueError(f"kv_connector_extra_config.{key} must be true or false, got {value!r}")


@dataclass(frozen=True)
class ConnectorSettings:
    """`kv_connector_extra_config` keys: `shm_name` (the own tier's region), `tier_bytes` (its size),
    `verify` (CRC32C on every load; default on), `load_async` (copy loads in the background while the
    request waits; default on; off: inside the step), `save_async` (publish saves in the background; default
    on; off: `wait_for_save` waits for them), `io_nice` (the tier I/O thread's nice value, 0-19; default
    `DEFAULT_IO_NICE`)."""

    shm_name: str
    tier_bytes: int = DEFAULT_TIER_BYTES
    verify: bool = True
    load_async: bool = True
    save_async: bool = True
    io_nice: int = DEFAULT_IO_NICE

    @classmethod
    def from_extra(cls, extra: Mapping[str, Any]) -> ConnectorSettings:
        name = str(extra.get("shm_name") or region_name("tier"))
        nice = extra.get("io_nice", DEFAULT_IO_NICE)
        if isinstance(nice, bool) or not isinstance(nice, int) or not 0 <= nice <= 19:
            raise ValueError(f"kv_connector_extra_config.io_nice must be an integer in [0, 19], got {nice!r}")
        return cls(
            name,
            int(extra.get("tier_bytes", DEFAULT_TIER_BYTES)),
            _flag(extra, "verify", True),
            _flag(extra, "load_async", True),
            _flag(extra, "save_async", True),
            nice,
        )


def layout_of(vllm_config: VllmConfig) -> KvLayout:
    """The KV layout this engine's connector exchanges blocks under (the same on both connector sides, and in
    the front end that names a prompt's blocks: read from the model config, `layout.layout_from_vllm`)."""
    return layout_from_vllm(vllm_config)


class KvmeshMetadata(ConnectorMetadata, KVConnectorMetadata):
    """`ConnectorMetadata` as vLLM's metadata type."""


class KvmeshStats(KVConnectorStats):
    """Block counts since the last report (`loaded_own`, `loaded_peer`, `load_failed`, `saved`, and
    `loaded_async`: those of the loaded blocks copied in the background); vLLM sums them over workers and
    hands them to the stat loggers as `SchedulerStats.kv_connector_stats`."""

    def reset(self) -> None:
        self.data = {}

    def aggregate(self, other: KVConnectorStats) -> KVConnectorStats:
        for k, v in other.data.items():
            self.data[k] = self.data.get(k, 0) + v
        return self

    def reduce(self) -> dict[str, int | float]:
        return dict(self.data)

    def is_empty(self) -> bool:
        return not any(self.data.values())


def _attach(name: str, layout: str | None = None) -> RegionReader | None:
    """A reader on region `name`, or None when there is none (or it holds another layout than `layout`)."""
    try:
        return RegionReader.attach(name, expect_layout=layout)
    except LOAD_ERRORS:
        return None


class KvCopier:
    """Block copies between the paged KV cache and host memory, run on the tier I/O thread.

    Loads go through `rows`, a staging chunk of `LOAD_CHUNK_BYTES` (pinned with KV on an accelerator): the
    tier copies blocks into its rows, `rows_to_kv` copies the first k rows into their vLLM blocks with one
    `index_copy_` per layer, so the thread makes a few torch calls per chunk, not a few per block and layer
    (each call takes the GIL back from the engine's thread; a thread holding the GIL between copies can
    keep a decode step waiting). Saves copy one block straight into a tier slot (`from_kv`). KV on an
    accelerator: the device copies run on a side stream of the connector's and wait only for it, never for
    the engine's stream; a save first makes the side stream wait for the event `mark` recorded after the
    step's forward (no host sync of the engine's stream)."""

    def __init__(self, kv: PagedKv, chunk_bytes: int) -> None:
        self.kv = kv
        device = kv.layers[0].device
        self.on_host = device.type == "cpu"
        self._stream: Any = None
        self._pinned: torch.Tensor | None = None
        if not self.on_host:
            self._stream = torch.cuda.Stream(device=device)
            self._pinned = torch.empty(kv.block_bytes, dtype=torch.uint8, pin_memory=True)
        n = max(1, min(LOAD_CHUNK_BLOCKS, chunk_bytes // kv.block_bytes))
        self._chunk = torch.empty((n, kv.block_bytes), dtype=torch.uint8, pin_memory=not self.on_host)
        self.rows = [self._chunk[i].numpy().data.cast("B") for i in range(n)]

    def mark(self) -> Any:
        """An event after the work the engine's stream has queued so far (None with KV on the CPU)."""
        if self.on_host:
            return None
        event = torch.cuda.Event()
        event.record()
        return event

    def rows_to_kv(self, block_ids: list[int]) -> None:
        """Copies rows 0..k-1 of the staging chunk into vLLM blocks `block_ids` (done on return)."""
        k = len(block_ids)
        if not k:
            return
        src = self._chunk[:k]
        if self.on_host:
            self._index_copy(block_ids, src)
            return
        with torch.cuda.stream(self._stream):
            self._index_copy(block_ids, src.to(self.kv.layers[0].device, non_blocking=True))
            self._stream.synchronize()  # the side stream only: the engine's stream is not waited for

    def _index_copy(self, block_ids: list[int], src: torch.Tensor) -> None:
        idx = torch.tensor(block_ids, dtype=torch.long, device=src.device)
        off, k = 0, len(block_ids)
        for t, n in zip(self.kv.layers, self.kv.layer_bytes, strict=True):
            t.index_copy_(0, idx, src[:, off : off + n].view(t.dtype).view(k, *t.shape[1:]))
            off += n

    def from_kv(self, block_id: int, dst: memoryview, after: Any = None) -> int:
        """Copies vLLM block `block_id` into `dst` (a whole block) and returns the CRC32C of the bytes."""
        if self.on_host:
            self.kv.gather(block_id, byte_tensor(dst))
            return checksum(dst)
        assert self._pinned is not None
        with torch.cuda.stream(self._stream):
            if after is not None:
                self._stream.wait_event(after)
            self.kv.gather(block_id, self._pinned)  # device -> pinned, synchronous on the side stream only
        return copy_checksum(dst, self._pinned.numpy().data)


@dataclass
class _Job:
    """One unit of the I/O thread's work: a request's loads, or a step's saves (after `after`, an event on
    the engine's stream); `done` is set when it ended (a synchronous caller waits on it)."""

    loads: list[LoadOp] = dataclasses.field(default_factory=list)
    saves: list[SaveOp] = dataclasses.field(default_factory=list)
    after: Any = None
    load_async: bool = False
    done: threading.Event = dataclasses.field(default_factory=threading.Event)


class _TierIo:
    """The worker side's one thread of tier I/O: runs `_Job`s in order through `run_job` (the region is
    single-writer, so every access to it and to peers' readers happens here). Daemon: an engine that exits
    without `shutdown` does not hang on it."""

    def __init__(self, run_job: Callable[[_Job], None], nice: int = 0) -> None:
        self._run_job = run_job
        self._nice = nice
        self._jobs: deque[_Job | None] = deque()
        self._cv = threading.Condition()
        self._thread = threading.Thread(target=self._loop, name="kvmesh-tier-io", daemon=True)
        self._thread.start()

    def submit(self, job: _Job) -> _Job:
        with self._cv:
            self._jobs.append(job)
            self._cv.notify()
        return job

    def run(self, job: _Job) -> None:
        """Runs `job` after the queued ones and waits for it."""
        self.submit(job).done.wait()

    def _loop(self) -> None:
        if self._nice:
            try:  # Linux: a thread's nice value is its own (setpriority on its thread id)
                os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), self._nice)
            except OSError as e:
                log.warning("kvmesh tier I/O thread keeps the engine's priority: %s", e)
        while True:
            with self._cv:
                while not self._jobs:
                    self._cv.wait()
                job = self._jobs.popleft()
            if job is None:
                return
            try:
                self._run_job(job)
            except Exception:  # a bug in a copy must not kill the thread every later step waits on
                log.exception("kvmesh tier I/O job failed")
            finally:
                job.done.set()

    def stop(self, timeout_s: float) -> bool:
        """Runs the queued jobs, then ends the thread; False if it is still running after `timeout_s`."""
        with self._cv:
            self._jobs.append(None)
            self._cv.notify()
        self._thread.join(timeout_s)
        return not self._thread.is_alive()


class KvmeshConnector(KVConnectorBase_V1):
    """See the module docstring."""

    def __init__(
        self, vllm_config: VllmConfig, role: KVConnectorRole, kv_cache_config: KVCacheConfig | None = None
    ) -> None:
        super().__init__(vllm_config=vllm_config, role=role, kv_cache_config=kv_cache_config)  # type: ignore[arg-type]
        request_amx_permission()  # also when vLLM did not find kvmesh's plugin entry point (plugin.py says why)
        self.settings = ConnectorSettings.from_extra(self._kv_transfer_config.kv_connector_extra_config or {})
        self.layout = layout_of(vllm_config)
        self._own_name = shard_region_name(self.settings.shm_name, self.layout)  # this rank's region
        self._bs = self.layout.block_size
        self._hash_bs = int(getattr(vllm_config.cache_config, "hash_block_size", None) or self._bs)
        kv_events = getattr(vllm_config, "kv_events_config", None)
        self._events_on = bool(kv_events is not None and kv_events.enable_kv_cache_events)
        self._readers: dict[str, RegionReader] = {}
        # scheduler side
        self._trackers: dict[str, RequestTracker] = {}
        self._requests: dict[str, Request] = {}  # the tracked requests (their vLLM block hashes)
        self._tier_events: list[KVCacheEvent] = []
        self._async_loads: list[LoadOp] = []  # issued by update_state_after_alloc, sent by build_connector_meta
        # worker side: the tier I/O thread's state, shared with the engine's thread under `_lock`
        self._region: TierRegion | None = None
        self._copier: KvCopier | None = None
        self._io: _TierIo | None = None
        self._lock = threading.Lock()
        self._saves_done = threading.Condition(self._lock)
        self._failed: set[int] = set()
        self._loaded: set[str] = set()  # asynchronous loads that ended, not reported yet
        self._cancelled: set[str] = set()  # requests finished (aborted) while their load was queued
        self._saving: Counter[str] = Counter()  # saves queued per request
        self._log = TierEventLog(self._bs)
        self.counts: dict[str, int] = defaultdict(int)
        # worker side, the engine's thread only
        self._loading: set[str] = set()  # asynchronous loads submitted, not reported yet
        self._saved_reqs: set[str] = set()  # requests that had saves (vLLM holds their blocks when finished)
        self._finishing: set[str] = set()  # finished requests whose saves are not all done yet

    @property
    def requires_kv_delivery(self) -> bool:
        return False  # a best-effort cache: a dropped save is a future miss

    # -- shared ---------------------------------------------------------------------------------------
    def _reader(self, name: str) -> RegionReader | None:
        """A cached read-only attachment to region `name` (None while it does not exist or holds blocks of
        another layout)."""
        r = self._readers.get(name)
        if r is None:
            r = _attach(name, self.layout.describe())
            if r is not None:
                self._readers[name] = r
        return r

    # -- scheduler side -------------------------------------------------------------------------------
    def _tracker(self, request: Request) -> RequestTracker:
        tr = self._trackers.get(request.request_id)
        if tr is None:
            lora = request.lora_request.lora_name if request.lora_request is not None else None
            salt = block_salt(self.layout, lora, request.cache_salt)
            tr = RequestTracker(request.all_token_ids, salt, self._bs, req_id=request.request_id)
            self._trackers[request.request_id] = tr
            self._requests[request.request_id] = request
        return tr

    def _keyed(self, req_id: str, ops: list[_Op]) -> list[_Op]:
        """`ops` with the vLLM names of the blocks they put in the own tier (saves, loads from a peer), when
        vLLM publishes KV events."""
        request = self._requests.get(req_id)
        if not self._events_on or request is None:
            return ops
        return [
            op
            if isinstance(op, LoadOp) and op.source == OWN
            else dataclasses.replace(op, key=block_key(request, op.index, self._bs, self._hash_bs))
            for op in ops
        ]

    def get_num_new_matched_tokens(self, request: Request, num_computed_tokens: int) -> tuple[int | None, bool]:
        tr = self._tracker(request)
        tr.planned = []
        if tr.load_failed or tr.loading:
            return 0, False  # looked up again after its load failed (or while it runs): computed by vLLM
        start, end = num_computed_tokens // self._bs, loadable_blocks(request.num_tokens, self._bs)
        want = tr.digests_upto(end)[start:]
        if not want:
            return 0, False
        own = self._reader(self._own_name)  # rank 0's shard: the scheduler's view of what every rank holds
        own_refs: list[SlotRef | None] = own.locate(want) if own is not None else [None] * len(want)
        pull = parse_pull(request.kv_transfer_params)
        peer_refs: list[SlotLike | None] = []
        peer_name, until = "", 0
        if pull is not None and pull.shm_name != self.settings.shm_name and lease_usable(pull, time.monotonic_ns()):
            peer = self._reader(shard_region_name(pull.shm_name, self.layout))
            if peer is not None:
                peer_refs = offered(pull, want, peer.locate(want))
                peer_name, until = pull.shm_name, pull.lease_until_ns
        tr.planned = plan_loads(start, own_refs, peer_refs, peer_name, until)
        n = len(tr.planned) * self._bs
        return n, bool(n) and self.settings.load_async

    def update_state_after_alloc(self, request: Request, blocks: KVCacheBlocks, num_external_tokens: int) -> None:
        tr = self._trackers.get(request.request_id)
        if tr is None:
            return
        tr.planned = tr.planned[: num_external_tokens // self._bs]
        if not tr.planned or not self.settings.load_async:
            return  # a synchronous load is sent with the request's first scheduled step
        # asynchronous: the request is not scheduled until the load ends, so its blocks are named now
        tr.block_ids = list(blocks.get_block_ids()[0])
        ops = self._keyed(request.request_id, tr.loads(request.request_id))
        tr.loading = {op.block_id for op in ops}
        self._async_loads += ops

    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> KVConnectorMetadata:
        meta = KvmeshMetadata()
        meta.async_loads, self._async_loads = self._async_loads, []
        meta.preempted = sorted(getattr(scheduler_output, "preempted_req_ids", None) or ())
        scheduled = scheduler_output.num_scheduled_tokens
        for new in scheduler_output.scheduled_new_reqs:
            tr = self._trackers.get(new.req_id)
            if tr is None:
                continue
            tr.block_ids = list(new.block_ids[0])
            meta.loads += self._keyed(new.req_id, tr.loads(new.req_id))
            meta.saves += self._keyed(new.req_id, tr.step(new.num_computed_tokens, scheduled.get(new.req_id, 0)))
        cached = scheduler_output.scheduled_cached_reqs
        for i, rid in enumerate(cached.req_ids):
            tr = self._trackers.get(rid)
            if tr is None:
                continue
            added = cached.new_block_ids[i]
            if rid in cached.resumed_req_ids:
                tr.block_ids = list(added[0]) if added else []  # a resumed request's list is all its blocks
            elif added:
                tr.block_ids.extend(added[0])
            meta.loads += self._keyed(rid, tr.loads(rid))
            meta.saves += self._keyed(rid, tr.step(cached.num_computed_tokens[i], scheduled.get(rid, 0)))
        return meta

    def request_finished(self, request: Request, block_ids: list[int]) -> tuple[bool, dict[str, Any] | None]:
        """Forgets the request; True (vLLM holds its blocks until `get_finished` reports it sent) when saves
        of its blocks were issued, which the worker side may still be copying. A request finished while its
        asynchronous load runs is held by vLLM itself until the load is reported."""
        tr = self._trackers.pop(request.request_id, None)
        self._requests.pop(request.request_id, None)
        return tr is not None and tr.saves_issued, None

    def update_connector_output(self, connector_output: KVConnectorOutput) -> None:
        events = connector_output.kv_cache_events
        if isinstance(events, KvmeshKVEvents):
            self._tier_events.extend(events.get_all_events())
        failed = set(connector_output.invalid_block_ids or ())
        if failed:  # may come a step before the load's end is reported: noted at once
            for waiting in self._trackers.values():
                if waiting.loading & failed:
                    waiting.load_failed = True
        for rid in connector_output.finished_recving or ():
            tr = self._trackers.get(rid)
            if tr is not None:
                tr.load_done(failed)

    def take_events(self) -> Iterable[KVCacheEvent]:
        """The tier's events the worker side reported since the last call (vLLM publishes them after its own
        events of the step)."""
        out, self._tier_events = self._tier_events, []
        return out

    # -- worker side: the engine's thread ---------------------------------------------------------------
    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        """Binds the paged KV tensors, creates the own tier region sized `tier_bytes` and starts the tier
        I/O thread."""
        try:
            kv = PagedKv(kv_caches, self.layout)  # vLLM's arrangement read from the tensors, checked
        except UnsupportedLayout as e:
            log.error("kvmesh connector off: %s", e)
            return
        slots = max(1, self.settings.tier_bytes // kv.block_bytes)
        self._region = self._create_region(slots, kv.block_bytes)
        self._copier = KvCopier(kv, LOAD_CHUNK_BYTES)
        # lowered only for background loads: a synchronous load is the step's critical path, at its priority
        self._io = _TierIo(self._run_job, self.settings.io_nice if self.settings.load_async else 0)
        log.info("kvmesh tier %s: %d slots of %d B (%s)", self._own_name, slots, kv.block_bytes, kv.describe())

    def _create_region(self, slots: int, block_bytes: int) -> TierRegion:
        name = self._own_name
        try:
            return TierRegion.create(name, block_bytes, slots, self.layout.describe())
        except FileExistsError:  # left behind by a killed engine of the same name: ours to replace
            with contextlib.suppress(FileNotFoundError):
                os.unlink(os.path.join(SHM_DIR, name))
            return TierRegion.create(name, block_bytes, slots, self.layout.describe())

    def start_load_kv(self, forward_context: ForwardContext, **kwargs: Any) -> None:
        meta = self._get_connector_metadata()
        if not isinstance(meta, ConnectorMetadata):
            return
        for ops in _by_request(meta.loads).values():  # the step's forward needs them: wait
            self._load_now(ops)
        for rid, ops in _by_request(meta.async_loads).items():
            self._loading.add(rid)
            if self._io is None:  # connector off: nothing is loaded, vLLM computes it all
                self._fail(ops, 0, "the connector is off")
                with self._lock:
                    self._loaded.add(rid)
                continue
            self._io.submit(_Job(loads=ops, load_async=True))

    def _load_now(self, ops: list[LoadOp]) -> None:
        if self._io is None:
            self._fail(ops, 0, "the connector is off")
            return
        self._io.run(_Job(loads=ops))

    def wait_for_layer_load(self, layer_name: str) -> None:
        return None  # a step's synchronous loads are done in start_load_kv; asynchronous ones are not its

    def save_kv_layer(
        self, layer_name: str, kv_layer: torch.Tensor, attn_metadata: AttentionMetadata, **kwargs: Any
    ) -> None:
        return None  # blocks are saved whole, after the forward (wait_for_save)

    def wait_for_save(self) -> None:
        if not self.has_connector_metadata():
            return
        meta = self._get_connector_metadata()
        if not isinstance(meta, ConnectorMetadata) or not meta.saves:
            return
        self._saved_reqs.update(op.req_id for op in meta.saves)
        if self._io is None or self._copier is None:
            return  # connector off: nothing is saved (the requests are still reported finished)
        with self._lock:
            self._saving.update(op.req_id for op in meta.saves)
        job = _Job(saves=list(meta.saves), after=self._copier.mark())
        if self.settings.save_async:
            self._io.submit(job)
        else:
            self._io.run(job)

    def handle_preemptions(self, kv_connector_metadata: KVConnectorMetadata) -> None:
        """Waits for the pending saves of the requests vLLM preempted this step: their blocks go back to the
        pool now and this step's forward may write them (rare; every other block a save reads stays
        allocated until `get_finished` reports its request's saves done)."""
        if not isinstance(kv_connector_metadata, ConnectorMetadata) or not kv_connector_metadata.preempted:
            return
        rids = set(kv_connector_metadata.preempted)
        with self._saves_done:
            while any(self._saving[r] for r in rids):
                self._saves_done.wait()

    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str] | None, set[str] | None]:
        """(requests whose saves are all done, of those finished with their blocks held; requests whose
        asynchronous load ended, loaded or failed: a failure's blocks are in `get_block_ids_with_load_errors`
        by then, as both are recorded at once)."""
        self._finishing |= finished_req_ids & self._saved_reqs
        self._saved_reqs -= finished_req_ids
        with self._lock:
            self._cancelled |= finished_req_ids & self._loading
            loaded, self._loaded = self._loaded, set()
            sent = {r for r in self._finishing if not self._saving[r]}
        self._loading -= loaded
        self._finishing -= sent
        with self._lock:
            self._cancelled -= loaded
        return sent or None, loaded or None

    def get_block_ids_with_load_errors(self) -> set[int]:
        with self._lock:
            failed, self._failed = self._failed, set()
        return failed

    def get_kv_connector_stats(self) -> KVConnectorStats | None:
        with self._lock:
            if not any(self.counts.values()):
                return None
            stats = KvmeshStats(dict(self.counts))
            self.counts.clear()
        return stats

    def get_kv_connector_kv_cache_events(self) -> KvmeshKVEvents | None:
        with self._lock:
            events = self._log.take()
        return KvmeshKVEvents(events) if events else None

    @classmethod
    def build_kv_connector_stats(cls, data: dict[str, Any] | None = None) -> KVConnectorStats | None:
        return KvmeshStats(dict(data or {}))

    def shutdown(self) -> None:
        if self._io is not None:
            io, self._io = self._io, None
            if not io.stop(SHUTDOWN_WAIT_S):  # unmapping regions under a running copy would fault: leave them
                log.error("kvmesh tier I/O thread still copying after %.0f s: regions left mapped", SHUTDOWN_WAIT_S)
                return
        for r in self._readers.values():
            r.close()
        self._readers.clear()
        if self._region is not None:
            self._region.close(unlink=True)
            self._region = None

    # -- worker side: the tier I/O thread -------------------------------------------------------------
    def _run_job(self, job: _Job) -> None:
        if job.loads:
            self._load(job.loads, job.load_async)
        if job.saves:
            self._save(job.saves, job.after)

    def _fail(self, ops: list[LoadOp], k: int, why: object) -> None:
        """Reports blocks `ops[k:]` failed (vLLM recomputes from the first)."""
        log.warning("kvmesh load failed at block %d (%s): %s; vLLM recomputes", ops[k].block_id, ops[k].source, why)
        with self._lock:
            self._failed.update(o.block_id for o in ops[k:])
            self.counts["load_failed"] += len(ops) - k

    def _load(self, ops: list[LoadOp], load_async: bool) -> None:
        """Loads a request's blocks in order, a staging chunk at a time; from the first that fails on, all
        are reported failed (with the request's end, for an asynchronous load, in one step: vLLM must see the
        failure no later)."""
        assert self._copier is not None
        rows = len(self._copier.rows)
        failed_at: tuple[int, str] | None = None
        for start in range(0, len(ops), rows):
            part = ops[start : start + rows]
            read, why = self._read_chunk(part, load_async)
            self._copier.rows_to_kv([op.block_id for op in part[:read]])
            with self._lock:
                for op in part[:read]:
                    self.counts["loaded_own" if op.source == OWN else "loaded_peer"] += 1
                    if load_async:
                        self.counts["loaded_async"] += 1
            if why is not None:
                failed_at = (start + read, why)
                break
        if failed_at is not None:
            self._fail(ops, *failed_at)
        if load_async:
            with self._lock:
                self._loaded.add(ops[0].req_id)

    def _read_chunk(self, part: list[LoadOp], load_async: bool) -> tuple[int, str | None]:
        """Copies `part`'s blocks, verified, into the staging rows: (how many, why the next one failed or
        None). A peer's block is also kept in the own tier (published with the CRC32C of the verified copy)."""
        assert self._copier is not None
        for j, op in enumerate(part):
            if load_async and self._is_cancelled(op.req_id):
                return j, "the request finished while it loaded"
            try:
                self._copy_in(op, self._copier.rows[j])
            except LOAD_ERRORS as e:  # kept as text: the exception's frames would pin the copy's buffers
                return j, f"{type(e).__name__}: {e}"
        return len(part), None

    def _is_cancelled(self, req_id: str) -> bool:
        with self._lock:
            return req_id in self._cancelled

    def _copy_in(self, op: LoadOp, row: memoryview) -> None:
        """Copies one block into a staging row, verified; a peer's block the own tier lacks is put there too."""
        if not lease_covers(op.lease_until_ns, time.monotonic_ns()):
            raise FailedPrecondition(f"the lease on region {op.source!r} ended before the copy")
        reader = self._reader(shard_region_name(op.source, self.layout) if op.source else self._own_name)
        if reader is None:
            raise FailedPrecondition(f"region {op.source!r} is gone")
        ref = SlotRef(op.slot, op.generation)
        if self.layout.tp_rank != 0:  # the scheduler located rank 0's shard; this rank's is found by its digest
            found = reader.locate([op.digest])[0]
            if found is None:
                raise FailedPrecondition(f"rank {self.layout.tp_rank}'s shard is not in {reader.shm_name!r}")
            ref = found
        n, crc = reader.read_checked(ref, op.digest, row, verify=self.settings.verify)
        region = self._region
        if op.source == OWN or region is None or region.locate([op.digest])[0] is not None:
            return
        res = region.reserve(op.digest, time.monotonic_ns())
        stored = False
        try:
            if res is not None:
                try:
                    byte_tensor(res.data[:n]).copy_(byte_tensor(row[:n]))  # a torch copy: the GIL is released
                except BaseException:
                    region.abort(res)
                    raise
                region.publish(res, n, crc, time.monotonic_ns())
                stored = True
        finally:
            with self._lock:  # the reserved slot's victim is announced evicted, stored or not
                self._log.evicted(region.drain_evicted())
                if stored:
                    self._log.stored(op.digest, op.key)

    def _save(self, saves: list[SaveOp], after: Any) -> None:
        """Copies each block out of the KV cache into a reserved slot of the own tier and publishes it (a
        block the tier holds already is skipped; with every slot leased, the block is dropped: a future
        miss); each save counts as done, for `get_finished`, whatever its outcome."""
        region, copier = self._region, self._copier
        for op in saves:
            stored = False
            try:
                if region is not None and copier is not None and region.locate([op.digest])[0] is None:
                    stored = self._store(region, copier, op, after)
            except LOAD_ERRORS as e:
                log.warning("kvmesh save of block %d failed: %s", op.block_id, e)
            finally:
                with self._saves_done:
                    if stored:
                        self.counts["saved"] += 1
                        self._log.evicted(region.drain_evicted() if region is not None else [])
                        self._log.stored(op.digest, op.key)
                    if self._saving[op.req_id] > 1:
                        self._saving[op.req_id] -= 1
                    else:
                        self._saving.pop(op.req_id, None)
                    self._saves_done.notify_all()

    @staticmethod
    def _store(region: TierRegion, copier: KvCopier, op: SaveOp, after: Any) -> bool:
        res = region.reserve(op.digest, time.monotonic_ns())
        if res is None:
            return False
        try:
            crc = copier.from_kv(op.block_id, res.data, after)
        except BaseException:
            region.abort(res)
            raise
        region.publish(res, len(res.data), crc, time.monotonic_ns())
        return True


def _by_request(ops: list[LoadOp]) -> dict[str, list[LoadOp]]:
    by_req: dict[str, list[LoadOp]] = defaultdict(list)
    for op in ops:
        by_req[op.req_id].append(op)
    return by_req
