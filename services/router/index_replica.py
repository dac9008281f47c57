"""The router's replica of the cache-manager's prefix index, with a FindMatches fallback.

The replica is a `kvmesh.replica.index.ReplicaIndex` kept by `kvmesh.replica.follower.IndexFollower` (the
same follower a cache-manager uses for another zone's index): a snapshot, or after a break only the deltas it
missed (a resumed stream), then live deltas, so `matches(hashes)` is a local, microsecond call. Deltas also
carry the medium (`tier_only` / `on_gpu`): `lookup` splits each match into its GPU run and the tier part
(`kvmesh.replica.media`). While the stream is down or the snapshot incomplete the replica is *stale* and
`matches` asks the cache-manager with `FindMatches` (bounded by `fallback_timeout_s`; on failure routing
continues without overlap). A resumed stream carries every missed revision and a gap reopens the stream,
so a break can never leave the replica silently wrong. Before every stream the cache-manager's block size
and hash salt model (`GetStats`) are checked against the router's (`expect`): a cache-manager that disagrees
is not used at all (no replica, no FindMatches) until it agrees; `check_agreement` lets the router refuse
to start against one. A prompt answered locally is reported to the cache-manager (`reports`,
`prefix_reports`), which counts it in its prefix statistics and hit ratio as it counts the FindMatches
fallback's queries.

Several router processes on one host (`kvmesh-router --processes N`) hold one replica between them
(`shared_index`, `kvmesh.replica.shared`): process 0 follows the cache-manager into shared memory
and beats every `HEARTBEAT_S`; the others do not follow, they read that copy and use FindMatches while it is
not fresh (no writer yet, a snapshot or break, a writer silent for `STALE_S`). `synced` is set in a reader
once the writer's copy is first fresh.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Sequence
from typing import Literal

import grpc
import numpy as np

from kvmesh.core.config import ServerSettings
from kvmesh.core.errors import FailedPrecondition
from kvmesh.core.tasks import stop_task
from kvmesh.index import PrefixIndex
from kvmesh.replica.follower import IndexFollower
from kvmesh.replica.index import ReplicaIndex
from kvmesh.replica.media import PrefixMatches
from kvmesh.replica.shared import SharedReplicaIndex, SharedReplicaView
from kvmesh.rpc.channel import ChannelSecurity
from kvmesh.services.router import metrics as m
from kvmesh.services.router.prefix_reports import PrefixReports
from kvmesh.services.router.settings import RouterSettings
from kvmesh.v1 import cache_manager_pb2

log = logging.getLogger(__name__)
REPORT_TIMEOUT_S = 2.0  # one ReportRoutedPrefixes call (entries queue meanwhile, or drop when full)
HEARTBEAT_S = 0.5  # a shared replica's writer beats this often; readers check it as often
SharedRole = Literal["", "writer", "reader"]
_FIND_MATCHES, _NONE = m.INDEX_LOOKUPS.labels("find_matches"), m.INDEX_LOOKUPS.labels("none")


def shared_role(settings: RouterSettings) -> SharedRole:
    """`--shared-index-role`, checked (ValueError naming the flag)."""
    role = settings.shared_index_role
    if role not in ("", "writer", "reader"):
        raise ValueError(f"--shared-index-role: writer or reader, got {role!r}")
    if bool(role) != bool(settings.shared_index):
        raise ValueError("--shared-index and --shared-index-role go together")
    return role  # type: ignore[return-value]


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
        shared_index: str = "",
        shared_role: SharedRole = "",
    ) -> None:
        if bool(shared_index) != bool(shared_role):
            raise ValueError("shared_index and shared_role go together")
        self.shared_role = shared_role
        replica = SharedReplicaIndex(shared_index) if shared_role == "writer" else ReplicaIndex()
        self.view = SharedReplicaView(shared_index) if shared_role == "reader" else None
        self.follower = IndexFollower(address, ChannelSecurity.of(settings), expect, replica=replica)
        self._reader_synced = asyncio.Event()
        self._answered_by = m.INDEX_LOOKUPS.labels("shared" if self.view is not None else "replica")
        self.fallback_timeout_s = fallback_timeout_s
        self.fallbacks = 0
        block_size = expect[0] if expect is not None else 0  # no block size known: no token ids reported
        self.reports = PrefixReports(
            self._report, block_size, report_queue, report_batch, report_flush_s, report_tokens
        )
        self._report_task: asyncio.Task[None] | None = None
        self._beat_task: asyncio.Task[None] | None = None

    @property
    def address(self) -> str:
        return self.follower.address

    @property
    def fresh(self) -> bool:
        """The local copy is complete (its stream is open, past its snapshot or resume); in a reader, the
        writer's copy is complete and its writer alive."""
        if self.view is not None:
            return self.view.fresh(time.monotonic_ns())
        return self.follower.replica.complete

    @property
    def index(self) -> PrefixIndex:
        return self.follower.replica.index

    def tier_pairs(self) -> int:
        return self.view.tier_pairs() if self.view is not None else self.follower.replica.tier_pairs()

    @property
    def revision(self) -> int:
        return self.view.revision if self.view is not None else self.follower.replica.revision

    @property
    def disagreement(self) -> str:
        """Why the cache-manager is not used ('' = it agrees or is unchecked); a reader has it from process 0."""
        if self.view is not None and self.view.disagrees:
            return "the cache-manager disagrees with the router's settings (found by router process 0)"
        return self.follower.disagreement

    @property
    def synced(self) -> asyncio.Event:
        return self._reader_synced if self.view is not None else self.follower.synced

    @property
    def updated(self) -> asyncio.Event:
        return self.follower.updated

    async def start(self) -> None:
        m.INDEX_TIER_ONLY.set_function(self.tier_pairs)  # at scrape time
        if self.view is None:
            self.follower.start()  # a reader keeps the channel (FindMatches, reports) but follows nothing
        if self.shared_role:
            self._beat_task = asyncio.create_task(self._beat(), name="shared-index-beat")
        self._report_task = asyncio.create_task(self.reports.run(), name="prefix-reports")

    async def _beat(self) -> None:
        """Writer: the heartbeat readers check. Reader: (re)opens the writer's files, sets `synced`."""
        replica = self.follower.replica
        while True:
            if isinstance(replica, SharedReplicaIndex):
                replica.beat(time.monotonic_ns(), disagrees=bool(self.follower.disagreement))
            elif self.view is not None and self.view.refresh() and self.fresh:
                self._reader_synced.set()
            await asyncio.sleep(HEARTBEAT_S)

    async def set_address(self, address: str) -> None:
        """Follows another cache-manager (from the failover service's endpoint sets): the replica restarts
        from that one's snapshot and is stale (FindMatches fallback) until it arrives."""
        if address != self.address:
            log.info("cache-manager %r -> %r", self.address, address)
        await self.follower.retarget(address)

    async def stop(self) -> None:
        await stop_task(self._beat_task)
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
        """Each worker's match and its leading GPU run (`kvmesh.replica.media`); local when fresh, else
        FindMatches (its `tier_blocks`), else empty. `hashes` are already salted with (model, lora, tenant);
        `tenant`/`lora` go to FindMatches for its per-tenant accounting; a local answer is reported."""
        if len(hashes) == 0:
            return PrefixMatches()
        found = self._local_lookup(hashes)
        if found is not None:
            self._answered_by.inc()
            self.reports.offer(hashes, max(found.total.values(), default=0), tenant, token_ids)
            return found
        stub = self.follower.stub
        if stub is None or self.disagreement:
            _NONE.inc()
            return PrefixMatches()
        self.fallbacks += 1
        req = cache_manager_pb2.FindMatchesRequest(
            block_hashes=cache_manager_pb2.BlockHashes(hashes=[int(h) for h in hashes]), tenant=tenant, lora_name=lora
        )
        try:
            resp = await stub.FindMatches(req, timeout=self.fallback_timeout_s)
        except grpc.aio.AioRpcError as e:
            log.debug("FindMatches failed: %s", e.code().name)
            _NONE.inc()
            return PrefixMatches()
        _FIND_MATCHES.inc()
        total = {m.worker_id: m.matched_blocks for m in resp.matches}
        return PrefixMatches({m.worker_id: m.matched_blocks - m.tier_blocks for m in resp.matches}, total)

    def _local_lookup(self, hashes: Sequence[int] | np.ndarray) -> PrefixMatches | None:
        """From this process's copy or the shared one; None when neither can answer (not fresh)."""
        if self.view is not None:
            return self.view.lookup(hashes, time.monotonic_ns())
        return self.follower.replica.lookup(hashes) if self.follower.replica.complete else None

    async def _report(self, request: cache_manager_pb2.ReportRoutedPrefixesRequest) -> None:
        """Sends one batch of routed-prompt reports to the cache-manager followed now."""
        stub = self.follower.stub
        if stub is None:
            raise FailedPrecondition("no cache-manager to report to")
        await stub.ReportRoutedPrefixes(request, timeout=REPORT_TIMEOUT_S)
