"""The router's replica of the cache-manager's prefix index, with a FindMatches fallback.

The replica is a `kvmesh.cachemgr.replica.ReplicaIndex` kept by `kvmesh.cachemgr.follower.IndexFollower` (the
same follower a cache-manager uses for another zone's index): a snapshot, or after a break only the deltas it
missed (a resumed stream), then live deltas, so `matches(hashes)` is a local, microsecond call. Deltas also
carry the medium (`tier_only` / `on_gpu`): `lookup` splits each match into its GPU run and the tier part
(`kvmesh.cachemgr.media`). While the stream is down or the snapshot incomplete the replica is *stale* and
`matches` asks the cache-manager with `FindMatches` (bounded by `fallback_timeout_s`; on failure routing
continues without overlap). A resumed stream carries every missed revision and a gap reopens the stream,
so a break can never leave the replica silently wrong. Before every stream the cache-manager's block size
and hash salt model (`GetStats`) are checked against the router's (`expect`): a cache-manager that disagrees
is not used at all (no replica, no FindMatches) until it agrees; `check_agreement` lets the router refuse
to start against one. A prompt answered locally is reported to the cache-manager (`reports`,
`prefix_reports`), which counts it in its prefix statistics and hit ratio as it counts the FindMatches
fallback's queries.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Sequence

import grpc
import numpy as np

from kvmesh.cachemgr.follower import IndexFollower
from kvmesh.cachemgr.media import PrefixMatches
from kvmesh.config import ServerSettings
from kvmesh.errors import FailedPrecondition
from kvmesh.index import PrefixIndex
from kvmesh.rpc.channel import ChannelSecurity
from kvmesh.services.router import metrics as m
from kvmesh.services.router.prefix_reports import PrefixReports
from kvmesh.tasks import stop_task
from kvmesh.v1 import cache_manager_pb2

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
        report_tokens: int = 16384,
    ) -> None:
        self.follower = IndexFollower(address, ChannelSecurity.of(settings), expect)
        self.fallback_timeout_s = fallback_timeout_s
        self.fallbacks = 0
        block_size = expect[0] if expect is not None else 0  # no block size known: no token ids reported
        self.reports = PrefixReports(
            self._report, block_size, report_queue, report_batch, report_flush_s, report_tokens
        )
        self._report_task: asyncio.Task[None] | None = None

    @property
    def address(self) -> str:
        return self.follower.address

    @property
    def fresh(self) -> bool:
        """The local copy is complete (its stream is open, past its snapshot or resume)."""
        return self.follower.replica.complete

    @property
    def index(self) -> PrefixIndex:
        return self.follower.replica.index

    @property
    def tier_only(self) -> dict[str, set[int]]:
        return self.follower.replica.tier_only

    @property
    def revision(self) -> int:
        return self.follower.replica.revision

    @property
    def disagreement(self) -> str:
        return self.follower.disagreement

    @property
    def synced(self) -> asyncio.Event:
        return self.follower.synced

    @property
    def updated(self) -> asyncio.Event:
        return self.follower.updated

    async def start(self) -> None:
        m.INDEX_TIER_ONLY.set_function(lambda: sum(len(s) for s in self.tier_only.values()))  # at scrape time
        self.follower.start()
        self._report_task = asyncio.create_task(self.reports.run(), name="prefix-reports")

    async def set_address(self, address: str) -> None:
        """Follows another cache-manager (from the failover service's endpoint sets): the replica restarts
        from that one's snapshot and is stale (FindMatches fallback) until it arrives."""
        if address != self.address:
            log.info("cache-manager %r -> %r", self.address, address)
        await self.follower.retarget(address)

    async def stop(self) -> None:
        await stop_task(self._report_task)
        await self.follower.stop()

    async def check_agreement(self, timeout_s: float = 5.0) -> None:
        """Raises FailedPrecondition if the cache-manager disagrees with `expect` (an unreachable one passes)."""
        await self.follower.check_agreement(timeout_s)

    def apply(self, msg: cache_manager_pb2.WatchIndexResponse) -> None:
        """Apply one WatchIndex message to the local copy."""
        self.follower.apply(msg, first=False)

    async def matches(self, hashes: Sequence[int] | np.ndarray, tenant: str = "", lora: str = "") -> dict[str, int]:
        """{worker: matched leading blocks, GPU or host tier} (see `lookup`)."""
        return (await self.lookup(hashes, tenant, lora)).total

    async def lookup(
        self,
        hashes: Sequence[int] | np.ndarray,
        tenant: str = "",
        lora: str = "",
        token_ids: Sequence[int] | np.ndarray | None = None,
    ) -> PrefixMatches:
        """Each worker's match and its leading GPU run (`kvmesh.cachemgr.media`); local when fresh, else
        FindMatches (its `tier_blocks`), else empty. `hashes` are already salted with (model, lora, tenant);
        `tenant`/`lora` go to FindMatches for its per-tenant accounting; a local answer is reported."""
        if len(hashes) == 0:
            return PrefixMatches()
        if self.fresh:
            found = self.follower.replica.lookup(hashes)
            self.reports.offer(hashes, max(found.total.values(), default=0), tenant, token_ids)
            return found
        stub = self.follower.stub
        if stub is None or self.disagreement:
            return PrefixMatches()
        self.fallbacks += 1
        req = cache_manager_pb2.FindMatchesRequest(
            block_hashes=cache_manager_pb2.BlockHashes(hashes=[int(h) for h in hashes]), tenant=tenant, lora_name=lora
        )
        try:
            resp = await stub.FindMatches(req, timeout=self.fallback_timeout_s)
        except grpc.aio.AioRpcError as e:
            log.debug("FindMatches failed: %s", e.code().name)
            return PrefixMatches()
        total = {m.worker_id: m.matched_blocks for m in resp.matches}
        return PrefixMatches({m.worker_id: m.matched_blocks - m.tier_blocks for m in resp.matches}, total)

    async def _report(self, request: cache_manager_pb2.ReportRoutedPrefixesRequest) -> None:
        """Sends one batch of routed-prompt reports to the cache-manager followed now."""
        stub = self.follower.stub
        if stub is None:
            raise FailedPrecondition("no cache-manager to report to")
        await stub.ReportRoutedPrefixes(request, timeout=REPORT_TIMEOUT_S)
