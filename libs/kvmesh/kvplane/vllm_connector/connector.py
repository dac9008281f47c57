"""`KvmeshConnector`: vLLM's KV connector (v1 API) over kvmesh's kv-sync tier regions.

Loaded by vLLM from `--kv-transfer-config`::

    {"kv_connector": "KvmeshConnector", "kv_connector_module_path": "kvmesh.kvplane.vllm_connector.connector",
     "kv_role": "kv_both", "kv_load_failure_policy": "recompute",
     "kv_connector_extra_config": {"shm_name": "kvmesh-tier-w1", "tier_bytes": 268435456}}

- Scheduler side (`get_num_new_matched_tokens`): claims the leading blocks beyond vLLM's own prefix
  hit that the worker's own tier (a `RegionReader` on its own region) or the peer named in the request's
  `kv_transfer_params["kvmesh_pull"]` holds. Lookups are one-sided scans of shared-memory headers: no
  network call, nothing that blocks the scheduler loop. Loads are synchronous (within the step).
- Worker side: `start_load_kv` copies each planned block from the tier into vLLM's paged KV cache (verified:
  generation, identity, CRC32C); a block that fails (StaleBlock, CorruptBlock, a region gone) is reported by
  `get_block_ids_with_load_errors`, so vLLM recomputes from it (`kv_load_failure_policy: recompute`); a block
  pulled from a peer is also kept in the own tier. `wait_for_save` stores the full blocks (prompt or
  generated) computed in the step in the own tier, which this process creates (`TierRegion.create`, name
  from the extra config).
- Tier events (`events.py`): when vLLM publishes KV events, each block the worker side puts in (or the tier
  evicts from) its own tier comes back in the step's connector output as `BlockStored` / `BlockRemoved`
  with medium "CPU" under vLLM's own block hashes; `take_events` hands them to vLLM's publisher.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import os
import time
from collections import defaultdict
from collections.abc import Iterable, Mapping
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
from kvmesh.kvplane.kvsync.tier import SHM_DIR, RegionReader, SlotRef, TierRegion, region_name
from kvmesh.kvplane.vllm_connector.blocks import PagedKv, byte_tensor
from kvmesh.kvplane.vllm_connector.events import KvmeshKVEvents, TierEventLog, block_key
from kvmesh.kvplane.vllm_connector.layout import KvLayout, block_salt
from kvmesh.kvplane.vllm_connector.plan import (
    OWN,
    BlockKey,
    ConnectorMetadata,
    LoadOp,
    RequestTracker,
    SaveOp,
    SlotLike,
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


@dataclass(frozen=True)
class ConnectorSettings:
    """`kv_connector_extra_config` keys: `shm_name` (the own tier's region), `tier_bytes` (its size),
    `verify` (CRC32C on every load; default on)."""

    shm_name: str
    tier_bytes: int = DEFAULT_TIER_BYTES
    verify: bool = True

    @classmethod
    def from_extra(cls, extra: Mapping[str, Any]) -> ConnectorSettings:
        name = str(extra.get("shm_name") or region_name("tier"))
        return cls(name, int(extra.get("tier_bytes", DEFAULT_TIER_BYTES)), bool(extra.get("verify", True)))


def layout_of(vllm_config: VllmConfig) -> KvLayout:
    """The KV layout this engine's connector exchanges blocks under (the same on both connector sides)."""
    mc, pc, cc = vllm_config.model_config, vllm_config.parallel_config, vllm_config.cache_config
    dtype = str(mc.dtype) if cc.cache_dtype == "auto" else f"torch.{cc.cache_dtype}"
    if dtype.startswith("torch.fp8"):
        dtype = "torch.uint8"
    return KvLayout(
        model=str(mc.model),
        dtype=dtype,
        block_size=int(cc.block_size),
        num_layers=int(mc.get_num_layers(pc)),
        num_kv_heads=int(mc.get_num_kv_heads(pc)),
        head_size=int(mc.get_head_size()),
        tp_rank=int(getattr(pc, "rank", 0)),
        tp_size=int(pc.tensor_parallel_size),
    )


class KvmeshMetadata(ConnectorMetadata, KVConnectorMetadata):
    """`ConnectorMetadata` as vLLM's metadata type."""


class KvmeshStats(KVConnectorStats):
    """Block counts since the last report (`loaded_own`, `loaded_peer`, `load_failed`, `saved`); vLLM sums
    them over workers and hands them to the stat loggers as `SchedulerStats.kv_connector_stats`."""

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


class KvmeshConnector(KVConnectorBase_V1):
    """See the module docstring."""

    def __init__(
        self, vllm_config: VllmConfig, role: KVConnectorRole, kv_cache_config: KVCacheConfig | None = None
    ) -> None:
        super().__init__(vllm_config=vllm_config, role=role, kv_cache_config=kv_cache_config)  # type: ignore[arg-type]
        request_amx_permission()  # also when vLLM did not find kvmesh's plugin entry point (plugin.py says why)
        self.settings = ConnectorSettings.from_extra(self._kv_transfer_config.kv_connector_extra_config or {})
        self.layout = layout_of(vllm_config)
        self._bs = self.layout.block_size
        self._hash_bs = int(getattr(vllm_config.cache_config, "hash_block_size", None) or self._bs)
        kv_events = getattr(vllm_config, "kv_events_config", None)
        self._events_on = bool(kv_events is not None and kv_events.enable_kv_cache_events)
        self._readers: dict[str, RegionReader] = {}
        # scheduler side
        self._trackers: dict[str, RequestTracker] = {}
        self._requests: dict[str, Request] = {}  # the tracked requests (their vLLM block hashes)
        self._tier_events: list[KVCacheEvent] = []
        # worker side
        self._region: TierRegion | None = None
        self._kv: PagedKv | None = None
        self._staging: bytearray = bytearray()
        self._failed: set[int] = set()
        self._log = TierEventLog(self._bs)
        self.counts: dict[str, int] = defaultdict(int)

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
            tr = self._trackers[request.request_id] = RequestTracker(request.all_token_ids, salt, self._bs)
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
        if self.layout.tp_size > 1:
            return 0, False  # one region per engine: tensor-parallel shards are not stored (yet)
        tr = self._tracker(request)
        start, end = num_computed_tokens // self._bs, loadable_blocks(request.num_tokens, self._bs)
        tr.planned = []
        want = tr.digests_upto(end)[start:]
        if not want:
            return 0, False
        own = self._reader(self.settings.shm_name)
        own_refs: list[SlotRef | None] = own.locate(want) if own is not None else [None] * len(want)
        pull = parse_pull(request.kv_transfer_params)
        peer_refs: list[SlotLike | None] = []
        if pull is not None and pull.shm_name != self.settings.shm_name and lease_usable(pull, time.monotonic_ns()):
            peer = self._reader(pull.shm_name)
            if peer is not None:
                peer_refs = offered(pull, want, peer.locate(want))
        tr.planned = plan_loads(start, own_refs, peer_refs, pull.shm_name if pull is not None else "")
        return len(tr.planned) * self._bs, False

    def update_state_after_alloc(self, request: Request, blocks: KVCacheBlocks, num_external_tokens: int) -> None:
        tr = self._trackers.get(request.request_id)
        if tr is not None:
            tr.planned = tr.planned[: num_external_tokens // self._bs]

    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> KVConnectorMetadata:
        meta = KvmeshMetadata()
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
        self._trackers.pop(request.request_id, None)
        self._requests.pop(request.request_id, None)
        return False, None

    def update_connector_output(self, connector_output: KVConnectorOutput) -> None:
        events = connector_output.kv_cache_events
        if isinstance(events, KvmeshKVEvents):
            self._tier_events.extend(events.get_all_events())

    def take_events(self) -> Iterable[KVCacheEvent]:
        """The tier's events the worker side reported since the last call (vLLM publishes them after its own
        events of the step)."""
        out, self._tier_events = self._tier_events, []
        return out

    # -- worker side ----------------------------------------------------------------------------------
    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        """Binds the paged KV tensors and creates the own tier region sized `tier_bytes`."""
        kv = PagedKv(kv_caches)
        if self.layout.tp_size > 1:
            log.error("kvmesh connector off: tensor parallelism (%d shards) is not supported", self.layout.tp_size)
            return
        if kv.block_bytes != self.layout.block_bytes or kv.dtype != self.layout.dtype:
            log.error(
                "kvmesh connector off: KV tensors hold %d B/block (%s), the layout says %d B (%s)",
                kv.block_bytes,
                kv.dtype,
                self.layout.block_bytes,
                self.layout.dtype,
            )
            return
        slots = max(1, self.settings.tier_bytes // kv.block_bytes)
        self._region = self._create_region(slots, kv.block_bytes)
        self._kv = kv
        self._staging = bytearray(kv.block_bytes)
        log.info("kvmesh tier %s: %d slots of %d B", self.settings.shm_name, slots, kv.block_bytes)

    def _create_region(self, slots: int, block_bytes: int) -> TierRegion:
        name = self.settings.shm_name
        try:
            return TierRegion.create(name, block_bytes, slots, self.layout.describe())
        except FileExistsError:  # left behind by a killed engine of the same name: ours to replace
            with contextlib.suppress(FileNotFoundError):
                os.unlink(os.path.join(SHM_DIR, name))
            return TierRegion.create(name, block_bytes, slots, self.layout.describe())

    def start_load_kv(self, forward_context: ForwardContext, **kwargs: Any) -> None:
        meta = self._get_connector_metadata()
        if not isinstance(meta, ConnectorMetadata) or not meta.loads or self._kv is None:
            return
        by_req: dict[str, list[LoadOp]] = defaultdict(list)
        for op in meta.loads:
            by_req[op.req_id].append(op)
        for ops in by_req.values():
            self._load_request(ops)

    def _load_request(self, ops: list[LoadOp]) -> None:
        """Loads a request's blocks in order; from the first that fails on, all are reported failed."""
        assert self._kv is not None
        staging, tensor = memoryview(self._staging), byte_tensor(self._staging)
        for k, op in enumerate(ops):
            try:
                reader = self._reader(op.source or self.settings.shm_name)
                if reader is None:
                    raise FailedPrecondition(f"region {op.source!r} is gone")
                reader.read_into(SlotRef(op.slot, op.generation), op.digest, staging, verify=self.settings.verify)
            except LOAD_ERRORS as e:
                log.warning("kvmesh load failed at block %d (%s): %s; vLLM recomputes", op.block_id, op.source, e)
                self._failed.update(o.block_id for o in ops[k:])
                self.counts["load_failed"] += len(ops) - k
                return
            self._kv.scatter(op.block_id, tensor)
            self.counts["loaded_own" if op.source == OWN else "loaded_peer"] += 1
            if op.source != OWN:
                self._keep(op.digest, staging, op.key, time.monotonic_ns())

    def _keep(self, digest: bytes, data: memoryview, key: BlockKey | None, now_ns: int) -> bool:
        """Puts a block the tier does not hold yet in the own tier, logging the put and what it evicted; a block
        it holds already is only touched (one more use for LFU, as `put` does) and not announced again."""
        region = self._region
        if region is None:
            return False
        if region.locate([digest])[0] is not None:
            region.put(digest, data, now_ns)
            return False
        stored = region.put(digest, data, now_ns)
        self._log.evicted(region.drain_evicted())
        if stored:
            self._log.stored(digest, key)
        return stored

    def wait_for_layer_load(self, layer_name: str) -> None:
        return None  # loads are synchronous, done in start_load_kv

    def save_kv_layer(
        self, layer_name: str, kv_layer: torch.Tensor, attn_metadata: AttentionMetadata, **kwargs: Any
    ) -> None:
        return None  # blocks are saved whole, after the forward (wait_for_save)

    def wait_for_save(self) -> None:
        if not self.has_connector_metadata():
            return
        meta = self._get_connector_metadata()
        if isinstance(meta, ConnectorMetadata) and meta.saves:
            self._save(meta.saves)

    def _save(self, saves: list[SaveOp]) -> None:
        region, kv = self._region, self._kv
        if region is None or kv is None:
            return
        tensor, now = byte_tensor(self._staging), time.monotonic_ns()
        for op in saves:
            if region.locate([op.digest])[0] is not None:
                continue
            kv.gather(op.block_id, tensor)
            if self._keep(op.digest, memoryview(self._staging), op.key, now):
                self.counts["saved"] += 1

    def get_kv_connector_stats(self) -> KVConnectorStats | None:
        if not any(self.counts.values()):
            return None
        stats = KvmeshStats(dict(self.counts))
        self.counts.clear()
        return stats

    def get_kv_connector_kv_cache_events(self) -> KvmeshKVEvents | None:
        events = self._log.take()
        return KvmeshKVEvents(events) if events else None

    @classmethod
    def build_kv_connector_stats(cls, data: dict[str, Any] | None = None) -> KVConnectorStats | None:
        return KvmeshStats(dict(data or {}))

    def get_block_ids_with_load_errors(self) -> set[int]:
        failed, self._failed = self._failed, set()
        return failed

    def shutdown(self) -> None:
        for r in self._readers.values():
            r.close()
        self._readers.clear()
        if self._region is not None:
            self._region.close(unlink=True)
            self._region = None
