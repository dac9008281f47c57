"""Hot-prefix replication between zones, both ends (decisions in `kvmesh.ops.warming.replicate`, pure).

Replicating side (`Replicator`, on when `--replication-bytes-per-s` > 0): every `--replication-interval-s`,
for each followed zone (`--follow-zone`: the same cache-managers, over the same kind of channel), the hot
prefixes not yet held there go, by value and under the zone's byte budget, as one `ReplicatePrefixes` call
naming for each a local worker that holds it (its KvSyncService address and tier region, from its GetInfo).
Each prefix sent carries a lease on its blocks at the source worker (`ReplicaPrefix.lease`), taken here, in
the source's zone, where the `AcquireLease` round trip is cheap: the receiving worker then only reads the
blocks (over Mooncake, one one-sided read across the inter-zone link instead of a lease call and a read). The
lease's identities are the source's tier digests, derived here from the prompt, the tenant and the source's
tier layout (`kvmesh.engine.sim.core.tier_digests`, the function the worker names its blocks with; a
simulated engine's only: a vLLM worker's identities need its KV layout, which only the worker knows, so its
prefixes go without a lease). It lasts `--replication-lease-ms`; a lease call that fails, or that finds the
source not holding every block under those identities, sends the prefix without one (the worker leases
itself, as it always may). Counted in `kvmesh_cache_replication_leases_total`.
A prefix counts as replicated only when the other zone answers that one of its workers holds every block,
verified; it is not sent again while the followed copy of that zone's index still shows it there (checked
once a replica is older than `RECHECK_AFTER_S`, the index's lag). A partition fails a round's call: nothing
is marked, the budget spent on it is not refunded, and the next round after the heal sends what is still
missing, never what was verified before. After each round a zone is *pending* (`pending_zones`, published as
the `replication_pending` registry meta, which the failover service reads to hold a restored zone's ramp)
while its index is not followed live, or a hot prefix that a local worker holds and that fits the budget's
burst is not verified there yet.

Receiving side (`ReplicaSink`, `ReplicatePrefixes`, role cache-manager): each prefix goes to the least loaded
worker (a worker that holds it already answers for it, nothing copied), as a prefill-only request whose
kv-pull hint names the source worker and carries the lease the request brought: the worker pulls the leading
blocks over kv-sync (each checked by CRC32C) into its CPU tier, under that lease when it still fits
(`kvmesh.kvplane.pulls`), loads them and computes only the last block. The answer's verified blocks are
its usage's cached tokens / block size. `--kvsync-address-map FROM=TO` rewrites a source address to the one
this zone's workers dial (a NAT or link proxy between the zones).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass

import grpc

from kvmesh.cachemgr.core import CacheCore
from kvmesh.core.errors import Unavailable
from kvmesh.engine.sim.core import SimConfig, tier_digests
from kvmesh.engine.sim.tiers import sim_layout
from kvmesh.kvplane.kvsync.client import KvSyncClient
from kvmesh.kvplane.pulls import carry
from kvmesh.ops.warming import WarmAction
from kvmesh.ops.warming.decide import pick_workers
from kvmesh.ops.warming.replicate import ByteBudget, Candidate, candidates, plan_round, unfinished
from kvmesh.replica.follower import RECONNECT
from kvmesh.rpc.channel import ZONE_LINK_OPTIONS, ChannelSecurity, open_channel
from kvmesh.rpc.validate import require
from kvmesh.services.cache_manager import metrics as m
from kvmesh.services.cache_manager.warming import ANY_LOAD, Warmer
from kvmesh.services.cache_manager.zones import ZoneFollowers
from kvmesh.v1 import cache_manager_pb2 as pb
from kvmesh.v1 import cache_manager_pb2_grpc, common_pb2, kvsync_pb2, worker_pb2, worker_pb2_grpc
from kvmesh.wire.proto import held_lease_to_proto

log = logging.getLogger(__name__)
MAX_PREFIXES = 64  # per ReplicatePrefixes call
MAX_PREFIX_TOKENS = 131_072
RECHECK_AFTER_S = 5.0  # a verified replica is looked up in the followed copy only after this (the index lag)
CALL_TIMEOUT_S = 60.0
LEASE_TIMEOUT_S = 1.0  # an AcquireLease on a worker of this zone: a slow one is not worth waiting for


def validate_replicate(request: pb.ReplicatePrefixesRequest, own_zone: str) -> None:
    """The whole request is checked, sizes first, before any of it is acted on."""
    require(len(request.prefixes) <= MAX_PREFIXES, "prefixes", f"at most {MAX_PREFIXES} per call")
    require(bool(request.prefixes), "prefixes", "at least one prefix")
    require(bool(request.source_zone), "source_zone", "required")
    require(request.source_zone != own_zone, "source_zone", f"is this cache-manager's own zone {own_zone!r}")
    for i, p in enumerate(request.prefixes):
        n = len(p.prompt.ids)
        require(0 < n <= MAX_PREFIX_TOKENS, f"prefixes[{i}].prompt.ids", f"1 to {MAX_PREFIX_TOKENS} token ids")
        require(bool(p.source_address), f"prefixes[{i}].source_address", "required")
        require(bool(p.region), f"prefixes[{i}].region", "required")


class ReplicaSink:
    """This zone's end of another zone's replication (see the module docstring)."""

    def __init__(self, core: CacheCore, warmer: Warmer, address_map: dict[str, str], pull_timeout_ms: int) -> None:
        self.core, self.warmer = core, warmer
        self.address_map = address_map
        self.pull_timeout_ms = pull_timeout_ms

    async def replicate(self, request: pb.ReplicatePrefixesRequest) -> pb.ReplicatePrefixesResponse:
        results = await asyncio.gather(*(self._one(p, request.source_zone) for p in request.prefixes))
        return pb.ReplicatePrefixesResponse(results=results)

    async def _one(self, p: pb.ReplicaPrefix, source_zone: str) -> pb.ReplicaResult:
        tokens, tenant = list(p.prompt.ids), p.tenant or None
        bs = self.core.block_size
        expected = (len(tokens) - 1) // bs
        held = sorted(self.warmer.holders(tokens, tenant))
        if held:
            return pb.ReplicaResult(worker_id=held[0], blocks=expected, blocks_expected=expected, already_held=True)
        chosen = pick_workers(set(), self.warmer.loads(), 1, ANY_LOAD)
        if not chosen:
            return pb.ReplicaResult(blocks_expected=expected, error="no worker registered in this zone")
        hint = worker_pb2.KvPullHint(
            source_worker_id=p.source_worker_id,
            source_address=self.address_map.get(p.source_address, p.source_address),
            region=p.region,
            num_blocks=expected,
            timeout_ms=self.pull_timeout_ms,
        )
        if p.HasField("lease"):  # taken by the asking zone next to the source: the worker only reads
            hint.lease.CopyFrom(p.lease)
        action = WarmAction(chosen[0], 0, tuple(tokens), f"replica-from-{source_zone}", tenant)
        try:
            usage = await self.warmer.pull_prefill(action, hint)
        except grpc.aio.AioRpcError as e:
            return pb.ReplicaResult(
                worker_id=chosen[0], blocks_expected=expected, error=f"{e.code().name}: {e.details()}"
            )
        got = min(expected, usage.cached_tokens // bs)
        err = "" if got >= expected else f"pulled {got} of {expected} blocks (the rest computed)"
        return pb.ReplicaResult(worker_id=chosen[0], blocks=got, blocks_expected=expected, error=err)


@dataclass(slots=True)
class Replica:
    """A prefix verified in another zone."""

    worker: str
    blocks: int
    hashes: list[int]
    at: float


@dataclass(slots=True)
class Target:
    """One zone replicated into."""

    zone: str
    stub: cache_manager_pb2_grpc.CacheManagerServiceStub
    budget: ByteBudget
    replicas: dict[int, Replica]
    bytes_total: int = 0
    failures_total: int = 0
    pending: bool = True  # see the module docstring; true until a round with the zone followed live says not


@dataclass(frozen=True, slots=True)
class Source:
    """A local worker's KvSyncService, as its GetInfo tells it; `layout` its tier's layout when its blocks'
    identities derive here (a simulated engine's), else empty."""

    worker: str
    address: str
    region: str
    block_bytes: int
    layout: str = ""


class Replicator:
    """This zone's hot prefixes kept in the followed zones (see the module docstring)."""

    def __init__(
        self,
        core: CacheCore,
        warmer: Warmer,
        zones: ZoneFollowers,
        security: ChannelSecurity,
        zone: str,
        bytes_per_s: float,
        interval_s: float,
        threshold: int,
        clock: Callable[[], float] = time.time,
        lease_ms: int = 10_000,
    ) -> None:
        self.core, self.warmer, self.zones, self.zone = core, warmer, zones, zone
        self.threshold = threshold
        self.clock = clock
        self.lease_ms = lease_ms
        self.security = security
        self.kvsync: dict[str, tuple[grpc.aio.Channel, KvSyncClient]] = {}  # source address -> its kv-sync
        opts = [*ZONE_LINK_OPTIONS, *RECONNECT]  # pings, and back within 2 s of a healed partition, as the followers
        self.channels = [open_channel(f.address, security, options=opts) for f in zones.followers.values()]
        now = clock()
        burst = bytes_per_s * max(interval_s, 1.0)
        self.targets = [
            Target(z, cache_manager_pb2_grpc.CacheManagerServiceStub(ch), ByteBudget(bytes_per_s, burst, now), {})
            for z, ch in zip(zones.followers, self.channels, strict=True)
        ]
        self.sources: dict[str, Source] = {}

    async def round(self) -> int:
        """One replication round into every target zone; returns prefixes newly verified."""
        now = self.clock()
        cands = candidates(self.core.stats.hot(now, self.threshold))
        done = 0
        for t in self.targets:
            live = self.zones.followers[t.zone].connected  # before _forget_gone reads the copy
            self._forget_gone(t, now)
            done += await self._round(t, cands, now)
            t.pending = not live or await self._backlog(t, cands)
            m.REPLICATION_PENDING.labels(t.zone).set(1 if t.pending else 0)
        return done

    def pending_zones(self) -> list[str]:
        """The followed zones this zone has not finished replicating into (as of the last round)."""
        return sorted(t.zone for t in self.targets if t.pending)

    async def _backlog(self, t: Target, cands: list[Candidate]) -> bool:
        """Whether hot prefixes that could go to `t` are not there yet (`replicate.unfinished`)."""
        held = lambda c: bool(self.warmer.holders(c.token_ids, c.tenant))  # noqa: E731
        return unfinished(cands, set(t.replicas), await self._block_bytes(), t.budget.burst, held)

    def _forget_gone(self, t: Target, now: float) -> None:
        """Replicas the followed copy of the zone no longer shows (evicted there): replicated again."""
        copy = self.zones.followers[t.zone].replica
        for key, r in list(t.replicas.items()):
            if now - r.at >= RECHECK_AFTER_S and copy.lookup(r.hashes).total.get(r.worker, 0) < r.blocks:
                del t.replicas[key]

    async def _round(self, t: Target, cands: list[Candidate], now: float) -> int:
        block_bytes = await self._block_bytes()
        if not block_bytes:
            return 0
        plan = plan_round(
            cands, set(t.replicas), t.budget.available(now), self.core.block_size, block_bytes, MAX_PREFIXES
        )
        items: list[tuple[Candidate, pb.ReplicaPrefix, Source]] = []
        for c in plan:
            src = await self._source_of(c)
            if src is not None:
                items.append((c, self._prefix(c, src), src))
        if not items:
            return 0
        leases = await asyncio.gather(*(self._lease(c, s) for c, _p, s in items))
        for (_c, p, _s), lease in zip(items, leases, strict=True):
            if lease is not None:
                p.lease.CopyFrom(lease)
        t.budget.spend(sum(c.n_blocks * s.block_bytes for c, _p, s in items))
        req = pb.ReplicatePrefixesRequest(source_zone=self.zone, prefixes=[p for _c, p, _s in items])
        t0 = time.perf_counter()
        try:
            resp = await t.stub.ReplicatePrefixes(req, timeout=CALL_TIMEOUT_S)
        except grpc.aio.AioRpcError as e:
            t.failures_total += len(items)
            m.REPLICATION_FAILURES.labels(t.zone, e.code().name).inc(len(items))
            log.warning("replication into zone %s failed: %s", t.zone, e.details())
            return 0
        m.REPLICATION_SECONDS.labels(t.zone).observe(time.perf_counter() - t0)
        return self._record(t, items, resp, now)

    def _record(
        self,
        t: Target,
        items: list[tuple[Candidate, pb.ReplicaPrefix, Source]],
        resp: pb.ReplicatePrefixesResponse,
        now: float,
    ) -> int:
        done = 0
        for (c, _p, src), r in zip(items, resp.results, strict=False):
            if r.error or r.blocks < r.blocks_expected:
                t.failures_total += 1
                m.REPLICATION_FAILURES.labels(t.zone, "unverified").inc()
                self.sources.pop(src.worker, None)  # asked again next time: the worker may have restarted
                continue
            hashes = self.core.hashes_of(c.token_ids, tenant=c.tenant)[: r.blocks]
            t.replicas[c.key] = Replica(r.worker_id, r.blocks, hashes, now)
            if not r.already_held:
                t.bytes_total += r.blocks * src.block_bytes
                m.REPLICATION_BYTES.labels(t.zone).inc(r.blocks * src.block_bytes)
            done += 1
        m.REPLICATED_PREFIXES.labels(t.zone).set(len(t.replicas))
        m.REPLICATED_BLOCKS.labels(t.zone).set(sum(r.blocks for r in t.replicas.values()))
        return done

    def _prefix(self, c: Candidate, src: Source) -> pb.ReplicaPrefix:
        return pb.ReplicaPrefix(
            prompt=common_pb2.TokenIds(ids=list(c.token_ids)),
            tenant=c.tenant or "",
            source_worker_id=src.worker,
            source_address=src.address,
            region=src.region,
        )

    async def _lease(self, c: Candidate, src: Source) -> kvsync_pb2.HeldLease | None:
        """A lease on the prefix's blocks (all but the last token's) at `src`, for the receiving worker to
        read under (see the module docstring); None: it leases itself."""
        bs = self.core.block_size
        n = (len(c.token_ids) - 1) // bs
        if not src.layout or n <= 0:
            m.REPLICATION_LEASES.labels("underived").inc()
            return None
        # a worker's sim engine keeps SimConfig's hash salt (no setting changes it)
        digests = tier_digests(c.token_ids[: n * bs], bs, src.layout, SimConfig().hash_salt, None, c.tenant)
        try:
            lease = await self._kvsync(src.address).acquire_lease(src.region, digests, self.lease_ms, LEASE_TIMEOUT_S)
        except grpc.aio.AioRpcError as e:
            m.REPLICATION_LEASES.labels("failed").inc()
            log.debug("no lease on %s at %s: %s", src.region, src.address, e.details())
            return None
        if lease.prefix < n:  # not every block under these identities (evicted, or another salt)
            m.REPLICATION_LEASES.labels("unheld").inc()
            return None
        m.REPLICATION_LEASES.labels("taken").inc()
        return held_lease_to_proto(carry(lease, time.time(), time.monotonic()))

    def _kvsync(self, address: str) -> KvSyncClient:
        """A kv-sync client of a worker of this zone (its address as GetInfo gives it), one per address."""
        entry = self.kvsync.get(address)
        if entry is None:
            channel = open_channel(address, self.security)
            entry = self.kvsync[address] = (channel, KvSyncClient(channel))
        return entry[1]

    async def _block_bytes(self) -> int:
        """Bytes of one tier block (the zone's workers share one layout), from any worker's GetInfo."""
        for w in sorted(self.warmer.addresses):
            src = await self._source(w)
            if src is not None:
                return src.block_bytes
        return 0

    async def _source_of(self, c: Candidate) -> Source | None:
        """A local worker holding the whole prefix, with a tier it serves."""
        for w in sorted(self.warmer.holders(c.token_ids, c.tenant)):
            src = await self._source(w)
            if src is not None:
                return src
        return None

    async def _source(self, worker: str) -> Source | None:
        src = self.sources.get(worker)
        if src is not None:
            return src
        try:
            stub = worker_pb2_grpc.WorkerServiceStub(self.warmer.worker_channel(worker))
            info = await stub.GetInfo(worker_pb2.GetInfoRequest(), timeout=5.0)
        except (grpc.aio.AioRpcError, Unavailable) as e:
            log.debug("no kv-sync source on %s: %s", worker, e)
            return None
        if not info.kvsync_address or not info.tier_block_bytes:
            return None
        # a simulated engine's tier layout is a function of what GetInfo tells (engine_factory.build_tiers)
        layout = sim_layout(info.model, info.block_size, info.tier_block_bytes) if info.engine == "sim" else ""
        src = Source(worker, info.kvsync_address, info.tier_region, info.tier_block_bytes, layout)
        self.sources[worker] = src
        return src

    def stats(self) -> list[pb.GetStatsResponse.ReplicationTarget]:
        """GetStats' `replication`."""
        return [
            pb.GetStatsResponse.ReplicationTarget(
                zone=t.zone,
                prefixes=len(t.replicas),
                blocks=sum(r.blocks for r in t.replicas.values()),
                bytes_total=t.bytes_total,
                failures_total=t.failures_total,
                budget_bytes_per_s=t.budget.rate,
                pending=t.pending,
            )
            for t in self.targets
        ]

    async def close(self) -> None:
        for ch in self.channels:
            await ch.close()
        for ch, client in self.kvsync.values():
            client.close()
            await ch.close()
        self.kvsync.clear()
