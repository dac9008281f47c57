"""The router's replica of the cache-manager's prefix index, with a FindMatches fallback.

`WatchIndex` streams a snapshot (deltas flagged `snapshot`, ended by `snapshot_done`) and then live deltas;
they are applied to a local `kvmesh.index.PrefixIndex`, so `matches(hashes)` is a local, microsecond call.
Deltas also carry the medium (`tier_only` / `on_gpu`): per worker the replica keeps the blocks it holds only
in a host tier, and `lookup` splits each match into its GPU run and the tier part (`kvmesh.cachemgr.media`).
While the stream is down or the snapshot incomplete the replica is *stale* and `matches` asks the
cache-manager with `FindMatches` (bounded by `fallback_timeout_s`; on failure routing continues without
overlap). A new stream starts from a fresh snapshot, so a gap can never leave the replica silently wrong.
A prompt answered locally is reported to the cache-manager (`reports`, `prefix_reports`), which counts it in
its prefix statistics and hit ratio as it counts the FindMatches fallback's queries.
Before every stream the cache-manager's block size and hash salt model (`GetStats`) are checked against the
router's (`expect`): a cache-manager that disagrees is not used at all (no replica, no FindMatches) until
it agrees; `check_agreement` lets the router refuse to start against one.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Iterable, Sequence

import grpc
import numpy as np

from kvmesh.cachemgr.media import PrefixMatches, split_matches
from kvmesh.config import ServerSettings
from kvmesh.errors import FailedPrecondition
from kvmesh.index import PrefixIndex
from kvmesh.rpc.agreement import Agreed, require_agreement
from kvmesh.rpc.channel import open_channel
from kvmesh.services.router import metrics as m
from kvmesh.services.router.prefix_reports import PrefixReports
from kvmesh.tasks import stop_task
from kvmesh.v1 import cache_manager_pb2, cache_manager_pb2_grpc

log = logging.getLogger(__name__)
REPORT_TIMEOUT_S = 2.0  # one ReportRoutedPrefixes call (entries queue meanwhile, or drop when full)


class IndexReplica:
    """Local index kept by WatchIndex; `address == ""` means no cache-manager (no overlap information)."""

    def __init__(
        self,
        address: str,
        settings: ServerSettings,
        fallback_timeout_s: float = 0.25,
        expect: tuple[int, str] | None = None,
        report_queue: int = 4096,
        report_batch: int = 256,
        report_flush_s: float = 0.1,
    ) -> None:
        self.address = address
        self.expect = expect  # (block size, salt model) the cache-manager must have; None = no check
        self.disagreement = ""  # why the current cache-manager is not used ('' = it agrees or is unchecked)
        self.fallback_timeout_s = fallback_timeout_s
        self.index = PrefixIndex()
        self.tier_only: dict[str, set[int]] = {}  # per worker, blocks it holds only in a host tier (CPU/disk)
        self.fresh = False
        self.revision = 0
        self.fallbacks = 0
        self.synced = asyncio.Event()
        self.updated = asyncio.Event()  # set after every applied message (tests and metrics wait on it)
        self._settings = settings
        self._started = False
        self._channel = open_channel(address, settings) if address else None
        self._stub = cache_manager_pb2_grpc.CacheManagerServiceStub(self._channel) if self._channel else None
        self._task: asyncio.Task[None] | None = None
        self._stopping = asyncio.Event()
        self.reports = PrefixReports(self._report, report_queue, report_batch, report_flush_s)
        self._report_task: asyncio.Task[None] | None = None

    async def start(self) -> None:
        self._started = True
        m.INDEX_TIER_ONLY.set_function(lambda: sum(len(s) for s in self.tier_only.values()))  # at scrape time
        if self._stub is not None:
            self._task = asyncio.create_task(self._follow())
        self._report_task = asyncio.create_task(self.reports.run(), name="prefix-reports")

    async def set_address(self, address: str) -> None:
        """Follows another cache-manager (from the failover service's endpoint sets): the replica restarts
        from that one's snapshot and is stale (FindMatches fallback) until it arrives."""
        if address == self.address:
            return
        log.info("cache-manager %r -> %r", self.address, address)
        if self._task is not None:
            await stop_task(self._task)
            self._task = None
        if self._channel is not None:
            await self._channel.close()
        self.address = address
        self.fresh = False
        self.disagreement = ""
        self.index = PrefixIndex()
        self.tier_only = {}
        self.synced.clear()
        self._channel = open_channel(address, self._settings) if address else None
        self._stub = cache_manager_pb2_grpc.CacheManagerServiceStub(self._channel) if self._channel else None
        if self._started and self._stub is not None:
            self._task = asyncio.create_task(self._follow())

    async def stop(self) -> None:
        self._stopping.set()
        await stop_task(self._report_task)
        if self._task is not None:
            await stop_task(self._task)
        if self._channel is not None:
            await self._channel.close()

    async def matches(self, hashes: Sequence[int] | np.ndarray, tenant: str = "", lora: str = "") -> dict[str, int]:
        """{worker: matched leading blocks, GPU or host tier} (see `lookup`)."""
        return (await self.lookup(hashes, tenant, lora)).total

    async def lookup(self, hashes: Sequence[int] | np.ndarray, tenant: str = "", lora: str = "") -> PrefixMatches:
        """Each worker's match and its leading GPU run (`kvmesh.cachemgr.media`); local when fresh, else
        FindMatches (its `tier_blocks`), else empty. `hashes` are already salted with (model, lora, tenant);
        `tenant`/`lora` go to FindMatches for its per-tenant accounting; a local answer is reported."""
        if len(hashes) == 0:
            return PrefixMatches()
        if self.fresh:
            total = self.index.find_matches(hashes)
            self.reports.offer(hashes, max(total.values(), default=0), tenant)
            return PrefixMatches(split_matches(hashes, total, self.tier_only), total)
        if self._stub is None or self.disagreement:
            return PrefixMatches()
        self.fallbacks += 1
        req = cache_manager_pb2.FindMatchesRequest(
            block_hashes=cache_manager_pb2.BlockHashes(hashes=[int(h) for h in hashes]), tenant=tenant, lora_name=lora
        )
        try:
            resp = await self._stub.FindMatches(req, timeout=self.fallback_timeout_s)
        except grpc.aio.AioRpcError as e:
            log.debug("FindMatches failed: %s", e.code().name)
            return PrefixMatches()
        total = {m.worker_id: m.matched_blocks for m in resp.matches}
        return PrefixMatches({m.worker_id: m.matched_blocks - m.tier_blocks for m in resp.matches}, total)

    async def _report(self, request: cache_manager_pb2.ReportRoutedPrefixesRequest) -> None:
        """Sends one batch of routed-prompt reports to the cache-manager followed now."""
        if self._stub is None:
            raise FailedPrecondition("no cache-manager to report to")
        await self._stub.ReportRoutedPrefixes(request, timeout=REPORT_TIMEOUT_S)

    def apply(self, msg: cache_manager_pb2.WatchIndexResponse) -> None:
        """Apply one WatchIndex message to the local index and the per-worker tier-only sets."""
        idx = self.index
        for d in msg.deltas:
            w = d.worker_id
            if d.cleared:
                idx.clear(w)
                self.tier_only.pop(w, None)
            if d.removed:
                idx.remove(w, np.fromiter(d.removed, dtype=np.uint64, count=len(d.removed)))
                self._drop_tier(w, d.removed)
            if d.stored:
                parent = d.parent if d.HasField("parent") else None
                idx.store(w, parent, np.fromiter(d.stored, dtype=np.uint64, count=len(d.stored)))
            if d.tier_only:
                self.tier_only.setdefault(w, set()).update(d.tier_only)
            if d.on_gpu:
                self._drop_tier(w, d.on_gpu)
        self.revision = msg.revision or self.revision
        if msg.snapshot_done:
            self.fresh = True
            self.synced.set()
        self.updated.set()

    def _drop_tier(self, worker: str, hashes: Iterable[int]) -> None:
        only = self.tier_only.get(worker)
        if only:
            only.difference_update(hashes)

    def _pairs(self, stats: cache_manager_pb2.GetStatsResponse) -> list[Agreed]:
        assert self.expect is not None
        block_size, salt_model = self.expect
        return [
            Agreed("--block-size", block_size, stats.block_size, unknown=stats.block_size == 0),
            Agreed("--salt-model (cache-manager --model)", salt_model, stats.model),
        ]

    async def check_agreement(self, timeout_s: float = 5.0) -> None:
        """Raises FailedPrecondition if the cache-manager disagrees with `expect`; an unreachable one passes
        (it is checked again before every index stream)."""
        if self._stub is None or self.expect is None:
            return
        try:
            stats = await self._stub.GetStats(cache_manager_pb2.GetStatsRequest(), timeout=timeout_s)
        except grpc.aio.AioRpcError as e:
            log.warning("cache-manager %s not reachable for the settings check: %s", self.address, e.code().name)
            return
        require_agreement(f"cache-manager {self.address}", self._pairs(stats))

    async def _agrees(self) -> bool:
        """Checks the cache-manager before a stream; a disagreement is logged once and keeps it unused."""
        try:
            await self.check_agreement(timeout_s=2.0)
        except FailedPrecondition as e:
            if e.message != self.disagreement:
                log.error("not using the cache-manager: %s", e.message)
            self.disagreement = e.message
            return False
        self.disagreement = ""
        return True

    async def _follow(self) -> None:
        assert self._stub is not None
        backoff = 0.05
        while not self._stopping.is_set():
            self.fresh = False
            self.index = PrefixIndex()
            self.tier_only = {}
            try:
                if not await self._agrees():
                    raise FailedPrecondition(self.disagreement)
                async for msg in self._stub.WatchIndex(cache_manager_pb2.WatchIndexRequest()):
                    self.apply(msg)
                    backoff = 0.05
            except asyncio.CancelledError:
                raise
            except grpc.aio.AioRpcError as e:
                log.info("index watch ended: %s", e.code().name)
            except FailedPrecondition:
                pass  # logged by _agrees; checked again after the back-off
            except Exception:
                log.exception("index watch failed")
            self.fresh = False
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._stopping.wait(), backoff)
            backoff = min(backoff * 2, 2.0)
