"""Cache-manager servicer: proto <-> domain over `kvmesh.cachemgr.core.CacheCore`."""

from __future__ import annotations

import asyncio
import logging
import math
import time
from collections.abc import AsyncIterator

import grpc

from kvmesh.cachemgr.core import CacheCore
from kvmesh.cachemgr.fanout import Watcher
from kvmesh.cachemgr.ingest import Phase
from kvmesh.cachemgr.journal import Entry
from kvmesh.cachemgr.publisher import PublisherGuard, PublishLimits
from kvmesh.cachemgr.routed import validate_report
from kvmesh.core.errors import FailedPrecondition, InvalidArgument, Unavailable
from kvmesh.index.types import IngestResult, Media, Stored
from kvmesh.rpc.audit import audited
from kvmesh.rpc.validate import require
from kvmesh.security.admin import no_unknown_fields
from kvmesh.security.identity import current_identity
from kvmesh.services.cache_manager import metrics as m
from kvmesh.services.cache_manager.replication import ReplicaSink, Replicator, validate_replicate
from kvmesh.services.cache_manager.warming import Warmer
from kvmesh.services.cache_manager.zones import ZoneFollowers, ZoneMatch
from kvmesh.v1 import cache_manager_pb2 as pb
from kvmesh.v1 import cache_manager_pb2_grpc, common_pb2
from kvmesh.wire.proto import batch_from_proto, delta_to_proto, events_from_proto

log = logging.getLogger(__name__)
SERVICE = "cache-manager"  # as the audit log names it
SNAPSHOT_CHUNK = 65_536  # block hashes per snapshot message


def policy_args(p: pb.WarmingPolicy) -> dict[str, object]:
    """A warming policy's fields as the audit log records them."""
    return {f.name: v for f, v in p.ListFields()}


def validate_find_matches(request: pb.FindMatchesRequest) -> None:
    """A query needs tokens or hashes."""
    require(request.WhichOneof("query") is not None, "query", "one of token_ids or block_hashes is required")


def stored_blocks(batch: common_pb2.KvEventBatch) -> int:
    """Blocks a batch stores (what a publisher stream's budget counts)."""
    return sum(len(e.block_stored.block_hashes) for e in batch.events if e.HasField("block_stored"))


def count(res: IngestResult, source: str) -> None:
    """Metrics of one ingestion step."""
    m.BATCHES.labels(source).inc(len(res.applied))
    if res.gap:
        m.GAPS.inc()
    if res.restart:
        m.RESTARTS.inc()
    if res.resync is not None:
        m.RESYNCS.labels("dump" if res.resync.full_dump else "replay").inc()


class CacheManagerServicer(cache_manager_pb2_grpc.CacheManagerServiceServicer):
    """The zone's KV prefix index."""

    def __init__(
        self,
        core: CacheCore,
        warmer: Warmer,
        stopping: asyncio.Event,
        location: str,
        limits: PublishLimits | None = None,
        zone: str = "",
        zones: ZoneFollowers | None = None,
        sink: ReplicaSink | None = None,
        replicator: Replicator | None = None,
    ) -> None:
        self.core = core
        self.sink = sink or ReplicaSink(core, warmer, {}, 10_000)  # another zone replicating into this one
        self.replicator = replicator  # this zone replicating into the followed ones (None: off)
        self.zone = zone  # this cache-manager's own zone
        self.zones = zones  # the zones it follows
        self.limits = limits or PublishLimits()
        self.warmer = warmer
        self.stopping = stopping
        self.location = location
        self._exported = (0, 0)  # the queried and hit blocks the counters hold

    def _export_queries(self) -> None:
        """After queries were counted: the since-start hit- and miss-ratio gauges, and the queried and hit block
        counters (what a rate over a window needs: an idle cache-manager's ratio is no signal)."""
        q = self.core.queries
        queried, hit = self._exported
        m.QUERIED_BLOCKS.inc(max(q.blocks_queried - queried, 0))
        m.HIT_BLOCKS.inc(max(q.blocks_hit - hit, 0))
        self._exported = (q.blocks_queried, q.blocks_hit)
        m.HIT_RATIO.set(q.hit_ratio)
        m.MISS_RATIO.set(1.0 - q.hit_ratio)

    # ---------------------------------------------------------------- ingestion
    def _hello_ack(self, worker_id: str, instance_id: str) -> pb.PublishKvEventsResponse:
        """The answer to a hello: where this instance's batches resume. An instance other than the one the index
        holds for the worker (a restarted worker, or one a checkpoint of another run knew) has sent nothing yet
        here: it is told 0, so it starts with a dump, which replaces the earlier instance's entries. Told the
        earlier instance's next sequence, it would replay its own batches from there and its first live batch
        would count as a gap (and a resync) on every first sync after a restart."""
        st = self.core.ingestor.workers.get(worker_id)
        if st is not None and st.instance_id != instance_id:
            return pb.PublishKvEventsResponse(next_sequence=0)
        return self._ack(worker_id, None)

    def _ack(self, worker_id: str, res: IngestResult | None) -> pb.PublishKvEventsResponse:
        st = self.core.ingestor.workers.get(worker_id)
        need = st is not None and st.phase is Phase.DUMP_NEEDED
        reason = res.resync.reason if res is not None and res.resync is not None else ("dump" if need else "")
        return pb.PublishKvEventsResponse(
            next_sequence=st.next_sequence if st else 0, resync_required=need, reason=reason
        )

    async def PublishKvEvents(  # type: ignore[override]
        self, request_iterator: AsyncIterator[pb.PublishKvEventsRequest], context: grpc.aio.ServicerContext
    ) -> AsyncIterator[pb.PublishKvEventsResponse]:
        """The publisher's identity and budget are checked (`kvmesh.cachemgr.publisher`) before a message
        touches the index; the hello's address is not trusted (`Warmer.register`)."""
        guard = PublisherGuard(current_identity(), self.limits, time.monotonic())
        worker_id = instance_id = ""
        while (req := await self._next_or_stop(request_iterator)) is not None:
            if req.HasField("hello"):
                worker_id, instance_id = req.hello.worker_id, req.hello.instance_id
                require(bool(worker_id), "hello.worker_id", "required")
                guard.admit_worker(worker_id, "hello.worker_id")
                if req.hello.block_size and req.hello.block_size != self.core.block_size:
                    raise InvalidArgument(
                        "hello.block_size",
                        f"cache-manager indexes blocks of "
                        f"{self.core.block_size} tokens, worker sends {req.hello.block_size}",
                    )
                self.warmer.register(worker_id, req.hello.address)
                if not req.HasField("batch"):
                    yield self._hello_ack(worker_id, instance_id)
                    continue
            require(bool(worker_id or req.batch.worker_id), "hello", "the first message must carry a hello")
            wid = req.batch.worker_id or worker_id
            guard.admit_worker(wid, "batch.worker_id")
            guard.admit_blocks(stored_blocks(req.batch), time.monotonic())
            res = self._apply(req, wid, instance_id)
            await self.core.persist()
            yield self._ack(wid, res)

    async def _next_or_stop(
        self, request_iterator: AsyncIterator[pb.PublishKvEventsRequest]
    ) -> pb.PublishKvEventsRequest | None:
        """The publisher's next message, None when it closed its side. A worker keeps its stream open between
        batches, so waiting for the next one would hold the graceful drain for the whole grace period: once
        `stopping` is set the wait ends and the stream fails UNAVAILABLE, telling the worker to reconnect (the
        message being applied is finished first; one not yet read is resent after the worker's resync)."""
        if self.stopping.is_set():
            raise Unavailable("cache-manager is shutting down: reconnect")
        nxt = asyncio.ensure_future(anext(request_iterator, None))
        stop = asyncio.ensure_future(self.stopping.wait())
        try:
            done, _ = await asyncio.wait({nxt, stop}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            for f in (nxt, stop):
                if not f.done():
                    f.cancel()
        if nxt in done:
            return nxt.result()  # read, so applied: the next call refuses once stopping
        raise Unavailable("cache-manager is shutting down: reconnect")

    def _apply(self, req: pb.PublishKvEventsRequest, wid: str, instance_id: str) -> IngestResult:
        kind = req.kind
        core = self.core
        if kind in (common_pb2.KV_STREAM_KIND_LIVE, common_pb2.KV_STREAM_KIND_UNSPECIFIED):
            batch = batch_from_proto(req.batch, wid, instance_id)
            res = core.apply(batch)
            m.EVENTS.inc(len(batch.events))
            if res.resync is not None and not res.resync.full_dump:
                # a gRPC stream is ordered and reliable: a gap means the worker reconnected after a loss,
                # and kvmesh workers resync by a full dump (PublishKvEventsResponse.resync_required)
                res.merge(core.replay_failed(wid, res.resync.reason))
        elif kind == common_pb2.KV_STREAM_KIND_DUMP_BEGIN:
            res = core.begin_dump(wid, req.batch.instance_id or instance_id, req.batch.timestamp or -math.inf)
            res.merge(core.apply_dump(wid, events_from_proto(req.batch)))
        elif kind == common_pb2.KV_STREAM_KIND_DUMP_CHUNK:
            res = core.apply_dump(wid, events_from_proto(req.batch))
        elif kind == common_pb2.KV_STREAM_KIND_DUMP_END:
            res = core.apply_dump(wid, events_from_proto(req.batch))
            res.merge(core.end_dump(wid, req.batch.sequence + 1))
        else:
            raise InvalidArgument("kind", f"unknown stream kind {kind}")
        count(res, "grpc")
        return res

    # ---------------------------------------------------------------- queries
    async def FindMatches(  # type: ignore[override]
        self, request: pb.FindMatchesRequest, context: grpc.aio.ServicerContext
    ) -> pb.FindMatchesResponse:
        validate_find_matches(request)
        core = self.core
        tokens = None
        tenant = request.tenant or None
        if request.WhichOneof("query") == "token_ids":
            tokens = list(request.token_ids.ids)
            hashes = core.hashes_of(tokens, request.model, request.lora_name or None, request.tenant or None)
        else:
            hashes = list(request.block_hashes.hashes)
        t0 = time.perf_counter()
        matches = core.find_matches(hashes, time.time(), tokens, tenant)
        m.QUERY_LATENCY.observe(time.perf_counter() - t0)
        self._export_queries()
        tiers = core.tier_blocks(hashes, matches)
        found = [ZoneMatch(self.zone, w, n, tiers[w]) for w, n in matches.items()]
        if request.all_zones and self.zones is not None:
            found += self.zones.matches(hashes)
        found.sort(key=lambda x: (-x.total, x.zone != self.zone, x.zone, x.worker))
        return pb.FindMatchesResponse(
            matches=[
                pb.WorkerMatch(worker_id=x.worker, matched_blocks=x.total, tier_blocks=x.tier, zone=x.zone)
                for x in found
            ],
            total_blocks=len(hashes),
            block_size=core.block_size,
        )

    async def ReportRoutedPrefixes(  # type: ignore[override]
        self, request: pb.ReportRoutedPrefixesRequest, context: grpc.aio.ServicerContext
    ) -> pb.ReportRoutedPrefixesResponse:
        """Prompts a router routed from its index replica, counted as FindMatches queries are
        (`kvmesh.cachemgr.routed`); the batch is checked whole before any of it is counted."""
        validate_report(request)
        now = time.time()
        for p in request.prefixes:
            tokens = p.token_ids or None
            self.core.count_query(p.blocks, p.checkpoint_hashes, p.hit_blocks, now, tokens, p.tenant or None)
        m.ROUTED_PREFIXES.inc(len(request.prefixes))
        self._export_queries()
        return pb.ReportRoutedPrefixesResponse(accepted=len(request.prefixes))

    async def ReplicatePrefixes(  # type: ignore[override]
        self, request: pb.ReplicatePrefixesRequest, context: grpc.aio.ServicerContext
    ) -> pb.ReplicatePrefixesResponse:
        """Another zone's hot prefixes, pulled into this zone's workers (`replication.ReplicaSink`)."""
        with audited(
            SERVICE,
            "CacheManagerService/ReplicatePrefixes",
            source_zone=request.source_zone,
            prefixes=len(request.prefixes),
        ) as a:
            no_unknown_fields(request)
            validate_replicate(request, self.zone)
            resp = await self.sink.replicate(request)
            for r in resp.results:
                outcome = "error" if r.error else ("held" if r.already_held else "pulled")
                m.REPLICAS_RECEIVED.labels(request.source_zone, outcome).inc()
            a["verified"] = sum(not r.error for r in resp.results)
            return resp

    def _start_watch(self, request: pb.WatchIndexRequest) -> tuple[Watcher, list[pb.WatchIndexResponse]]:
        """The watcher and the stream's first messages: the missed deltas when the request's resume point is
        still in the journal, else a snapshot; the first message names the epoch."""
        core = self.core
        resumed = None
        if request.resume_epoch:
            resumed = core.resume(request.worker_ids, request.resume_epoch, request.resume_revision)
        if resumed is not None:
            watcher, entries = resumed
            first = [pb.WatchIndexResponse(resumed=True, revision=request.resume_revision)]
            msgs, kind = first + [entry_message(e) for e in entries], "resumed"
        else:
            watcher, rev, snap = core.watch(request.worker_ids)
            msgs, kind = snapshot_messages(snap, rev), "snapshot"
        msgs[0].epoch = core.journal.epoch
        m.WATCH_STREAMS.labels(kind).inc()
        m.WATCH_DELTAS.labels(kind).inc(sum(len(x.deltas) for x in msgs))
        return watcher, msgs

    async def WatchIndex(  # type: ignore[override]
        self, request: pb.WatchIndexRequest, context: grpc.aio.ServicerContext
    ) -> AsyncIterator[pb.WatchIndexResponse]:
        """A snapshot or, from a resume point the journal still holds, only the missed deltas; then live ones."""
        watcher, first = self._start_watch(request)
        m.WATCHERS.inc()
        stopper = asyncio.ensure_future(self.stopping.wait())
        try:
            for msg in first:
                yield msg
            while not self.stopping.is_set():
                get = asyncio.ensure_future(watcher.queue.get())
                done, _ = await asyncio.wait({get, stopper}, return_when=asyncio.FIRST_COMPLETED)
                if get not in done:
                    get.cancel()
                    break
                item = get.result()
                if item is None:
                    raise FailedPrecondition("watch fell behind or the index was restored: re-subscribe")
                m.WATCH_DELTAS.labels("live").inc(len(item.deltas))
                yield entry_message(item)
        finally:
            stopper.cancel()
            self.core.fanout.remove(watcher)
            m.WATCHERS.dec()

    # ---------------------------------------------------------------- warming (admin)
    async def WarmPrefixes(  # type: ignore[override]
        self, request: pb.WarmPrefixesRequest, context: grpc.aio.ServicerContext
    ) -> pb.WarmPrefixesResponse:
        with audited(
            SERVICE, "CacheManagerService/WarmPrefixes", prompts=len(request.prompts), replicas=request.replicas
        ) as a:
            no_unknown_fields(request)
            prompts = [list(p.ids) for p in request.prompts]
            require(bool(prompts), "prompts", "at least one prompt")
            for i, p in enumerate(prompts):
                require(bool(p), f"prompts[{i}].ids", "must not be empty")
            n = await self.warmer.warm_now(prompts, request.replicas)
            a["requests_issued"] = n
            return pb.WarmPrefixesResponse(requests_issued=n)

    async def SetWarmingPolicy(  # type: ignore[override]
        self, request: pb.SetWarmingPolicyRequest, context: grpc.aio.ServicerContext
    ) -> pb.SetWarmingPolicyResponse:
        p = request.policy
        with audited(SERVICE, "CacheManagerService/SetWarmingPolicy", **policy_args(p)):
            no_unknown_fields(request)
            require(request.HasField("policy"), "policy", "required")
            require(not p.lfu_weight or 0.0 <= p.lfu_weight <= 1.0, "policy.lfu_weight", "must be in [0, 1]")
            require(not p.window_s or 0.0 < p.window_s < math.inf, "policy.window_s", "must be positive and finite")
            return pb.SetWarmingPolicyResponse(policy=self.warmer.set_policy(p))

    # ---------------------------------------------------------------- checkpoints (admin) and stats
    async def Checkpoint(  # type: ignore[override]
        self, request: pb.CheckpointRequest, context: grpc.aio.ServicerContext
    ) -> pb.CheckpointResponse:
        with audited(SERVICE, "CacheManagerService/Checkpoint") as a:
            no_unknown_fields(request)
            if self.core.store is None:
                raise FailedPrecondition("no checkpoint store configured (--redis-url or --checkpoint-dir)")
            t0 = time.perf_counter()
            try:
                pairs, size = await self.core.checkpoint()
            except Exception as e:
                m.store_failure(e)
                raise
            m.CHECKPOINTS.inc()
            m.CHECKPOINT_SECONDS.observe(time.perf_counter() - t0)
            a.update(pairs=pairs, bytes=size)
            return pb.CheckpointResponse(location=self.location, pairs=pairs, bytes=size)

    async def Restore(  # type: ignore[override]
        self, request: pb.RestoreRequest, context: grpc.aio.ServicerContext
    ) -> pb.RestoreResponse:
        with audited(SERVICE, "CacheManagerService/Restore") as a:
            no_unknown_fields(request)
            if self.core.store is None:
                raise FailedPrecondition("no checkpoint store configured (--redis-url or --checkpoint-dir)")
            t0 = time.perf_counter()
            rec = await self.core.restore()
            a.update(pairs=self.core.index.num_pairs(), events_replayed=rec.records)
            return pb.RestoreResponse(
                pairs=self.core.index.num_pairs(), events_replayed=rec.records, seconds=time.perf_counter() - t0
            )

    async def GetStats(  # type: ignore[override]
        self, request: pb.GetStatsRequest, context: grpc.aio.ServicerContext
    ) -> pb.GetStatsResponse:
        core = self.core
        c = core.ingestor.counters
        refresh_gauges(core)
        return pb.GetStatsResponse(
            workers=len(core.index.workers()),
            blocks=core.index.num_entries(),
            pairs=core.index.num_pairs(),
            batches_total=c.batches,
            gaps_total=c.gaps,
            resyncs_total=c.resyncs_full,
            hit_ratio=core.queries.hit_ratio,
            warming_actions_total=self.warmer.actions_total,
            block_size=core.block_size,
            model=core.model,
            top_prefixes=top_prefixes(core, request.top_prefixes),
            zone=self.zone,
            followed_zones=self.zones.stats() if self.zones is not None else [],
            replication=self.replicator.stats() if self.replicator is not None else [],
        )


def entry_message(e: Entry) -> pb.WatchIndexResponse:
    """One revision's deltas as a watch message."""
    return pb.WatchIndexResponse(deltas=[delta_to_proto(d) for d in e.deltas], revision=e.revision, ingested_at=e.at)


def snapshot_messages(snap: list[tuple[Stored, Media]], revision: int) -> list[pb.WatchIndexResponse]:
    """A watch's snapshot: per worker `cleared` + its blocks, then its tier-only blocks, in chunks of
    `SNAPSHOT_CHUNK` hashes, one delta a message, the last one `snapshot_done`."""
    deltas = []
    for stored, media in snap:
        hs = list(stored.hashes)
        for i in range(0, max(len(hs), 1), SNAPSHOT_CHUNK):
            deltas.append(pb.IndexDelta(worker_id=stored.worker, cleared=(i == 0), stored=hs[i : i + SNAPSHOT_CHUNK]))
        tier = list(media.tier_only)
        for i in range(0, len(tier), SNAPSHOT_CHUNK):  # after the blocks: a replica applies stored first
            deltas.append(pb.IndexDelta(worker_id=stored.worker, tier_only=tier[i : i + SNAPSHOT_CHUNK]))
    if not deltas:
        return [pb.WatchIndexResponse(snapshot=True, snapshot_done=True, revision=revision)]
    last = len(deltas) - 1
    return [
        pb.WatchIndexResponse(deltas=[d], snapshot=True, revision=revision, snapshot_done=i == last)
        for i, d in enumerate(deltas)
    ]


MAX_TOP_PREFIXES = 1000


def top_prefixes(core: CacheCore, n: int) -> list[pb.PrefixStat]:
    """The `n` (at most MAX_TOP_PREFIXES) most-queried prefixes of the statistics window, most first."""
    require(n <= MAX_TOP_PREFIXES, "top_prefixes", f"at most {MAX_TOP_PREFIXES}")
    if n == 0:
        return []
    return [
        pb.PrefixStat(
            key=k,
            blocks=v.n_blocks,
            window_count=v.count,
            total=v.total,
            last_seen=v.last_seen,
            tenant=v.tenant or "",
        )
        for k, v in core.stats.top(time.time(), n)
    ]


def refresh_gauges(core: CacheCore) -> None:
    """Index-size gauges (O(index) popcount: called on GetStats and every few seconds)."""
    st = core.index.stats()
    m.INDEX_BLOCKS.set(st["blocks"])
    m.INDEX_PAIRS.set(st["pairs"])
    m.INDEX_BYTES.set(st["bytes"])
    m.WORKERS.set(st["workers"])
