"""The worker's data plane: its KvSyncService server over its CPU tier, and pulls from peers.

`KvSyncServer` serves the engine's CPU tier region (`TIER_REGION`) on a gRPC server of its own (a separate
port, so bulk KV streams never queue behind generation traffic); the address goes into GetInfo. `PeerPulls`
is the simulated engine's `pull_transport`: one `KvSyncClient` per peer address, which reads the peer's
shared memory when it attaches here and streams over gRPC otherwise; any failure raises `PullFailed`.

On a vLLM worker the tier belongs to the KV connector in vLLM's engine-core process: the worker attaches it
read-only (`RegionReader`) and serves it, this process being the lessor (`AcquireLease` writes the lease
array). `VllmPulls` turns a Generate's pull hint into the connector's `kv_transfer_params`: a lease on a
same-host source's region, or, for a source on another host, blocks streamed over gRPC into this worker's
`PullStaging` region and leased there; either way the connector reads one-sided shared memory. A pull that
fails part-way keeps its leading verified blocks (`PullFailed.delivered`): the simulated engine stores
them, a vLLM worker stages and leases them; the rest is computed.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import grpc

from kvmesh.core.errors import NotFound
from kvmesh.core.generation import EngineRequest
from kvmesh.engine.sim.tiers import PullHint
from kvmesh.kvplane.kvsync.client import KvSyncClient, Lease, PullFailed, PullStats
from kvmesh.kvplane.kvsync.service import MAX_BLOCKS, REQUEST_BOUNDS, KvSyncServicer, add_to_server
from kvmesh.kvplane.kvsync.tier import RegionReader, Reservation, SlotRef, TierRegion, region_name
from kvmesh.kvplane.vllm_connector.layout import KvLayout, block_digests
from kvmesh.kvplane.vllm_connector.plan import PULL_KEY
from kvmesh.rpc.auth import Guard
from kvmesh.rpc.channel import open_channel
from kvmesh.rpc.interceptors import InstrumentedServer, MessageBounds
from kvmesh.rpc.tls import server_credentials
from kvmesh.services.worker import metrics as m
from kvmesh.services.worker.settings import WorkerSettings
from kvmesh.v1 import worker_pb2

if TYPE_CHECKING:
    from kvmesh.engine.vllm_engine import VllmEngine

log = logging.getLogger(__name__)
TIER_REGION = "cpu"
STAGING_TAG = "pull-staging"  # the staging region is kvmesh-<pid>-pull-staging (orphans are found by pid)
STREAM_MARGIN_S = 0.05  # a staging stream ends this long before the hint's deadline, to stage what it got
_SERVER_OPTIONS: Sequence[tuple[str, Any]] = (
    ("grpc.max_receive_message_length", 8 << 20),
    ("grpc.max_send_message_length", 64 << 20),
)


class KvSyncServer:
    """KvSyncService over one CPU tier region (owned here, or a vLLM connector's attached), on its own port."""

    def __init__(self, region: TierRegion | RegionReader, settings: WorkerSettings) -> None:
        self.region = region
        self.settings = settings
        self.server = grpc.aio.server(options=list(_SERVER_OPTIONS))
        servicer = KvSyncServicer({TIER_REGION: region})
        bounds = MessageBounds(per_method=REQUEST_BOUNDS)
        guard = Guard.from_settings(settings, "kvsync")  # the worker's own table: workers and peer zones only
        add_to_server(servicer, InstrumentedServer(self.server, "kvsync", bounds, guard))
        self.port = 0

    async def start(self) -> str:
        """Binds and starts; returns the address peers reach it at."""
        s = self.settings
        bind = f"{s.host}:{s.kvsync_port}"
        if s.tls_cert:  # the same TLS / mTLS as the worker's own server
            self.port = self.server.add_secure_port(bind, server_credentials(s.tls_cert, s.tls_key, s.tls_client_ca))
        else:
            self.port = self.server.add_insecure_port(bind)
        await self.server.start()
        host = s.advertise_address.rsplit(":", 1)[0] if s.advertise_address else s.host
        address = f"{host}:{self.port}"
        log.info("kv-sync serving region %r (%s) on %s", TIER_REGION, self.region.shm_name, address)
        return address

    async def stop(self) -> None:
        await self.server.stop(grace=1.0)
        if isinstance(self.region, RegionReader):  # an owner's region is closed by its owner
            self.region.close()


def vllm_tier_server(shm_name: str, settings: WorkerSettings) -> KvSyncServer | None:
    """KvSyncServer over the vLLM connector's tier (attached read-only once vLLM registered its KV caches);
    None when there is no such region (connector off, or its layout unsupported)."""
    try:
        return KvSyncServer(RegionReader.attach(shm_name), settings)
    except NotFound:
        log.warning("no vLLM connector tier %r: kv-sync not served", shm_name)
        return None


class PeerPulls:
    """`pull_transport` of the simulated engine: pulls from the peers hints name (clients kept per address)."""

    def __init__(self, settings: WorkerSettings) -> None:
        self.settings = settings
        self._clients: dict[str, tuple[grpc.aio.Channel, KvSyncClient]] = {}

    def timeout_ms(self, hint: PullHint) -> int:
        """The pull's deadline: the hint's, capped by this worker's own."""
        cap = self.settings.pull_timeout_ms
        return min(hint.timeout_ms or cap, cap)

    def client(self, address: str) -> KvSyncClient:
        entry = self._clients.get(address)
        if entry is None:
            channel = open_channel(address, self.settings, propagate=False)
            entry = self._clients[address] = (channel, KvSyncClient(channel))
        return entry[1]

    async def __call__(self, hint: PullHint, digests: Sequence[bytes], outs: Sequence[memoryview], layout: str) -> int:
        """The leading blocks copied and verified into `outs`; raises `PullFailed` (its `blocks`: the leading
        ones verified before the failure, which the engine keeps)."""
        s = self.settings
        timeout_ms = self.timeout_ms(hint)
        stats = await self.client(hint.source_address).pull(
            hint.region or TIER_REGION,
            digests,
            outs,
            layout,
            ttl_ms=hint.lease_ms or s.pull_lease_ms,
            timeout_s=timeout_ms / 1000.0,
            prefer_shm=s.pull_over_shm,
        )
        log.debug("pulled %d blocks from %s over %s", stats.blocks, hint.source_address, stats.transport)
        return stats.blocks

    async def close(self) -> None:
        for channel, client in self._clients.values():
            client.close()
            await channel.close()
        self._clients.clear()


def hint_from_proto(h: worker_pb2.KvPullHint) -> PullHint:
    """The proto pull hint as the engine's."""
    return PullHint(
        source_address=h.source_address,
        region=h.region,
        num_blocks=h.num_blocks,
        source_worker_id=h.source_worker_id,
        shm_name=h.region_shm_name,
        digests=tuple(h.block_digests),
        lease_ms=h.lease_ms,
        expires_unix_ms=h.expires_unix_ms,
        timeout_ms=h.timeout_ms,
    )


def leased_prefix(lease: Lease) -> list[bytes]:
    """The digests of the lease's leading held blocks (what a pull can load)."""
    return lease.digests[: lease.prefix]


def vllm_pull_params(shm_name: str, lease: Lease) -> dict[str, Any] | None:
    """The vLLM connector's `kv_transfer_params` for a leased peer region (digests hex-encoded, JSON-safe:
    the connector claims only the leased blocks); None when the lease holds no leading block."""
    return connector_params(shm_name, lease.lease_until_ns, leased_prefix(lease))


def connector_params(shm_name: str, lease_until_ns: int, digests: Sequence[bytes]) -> dict[str, Any] | None:
    """`{PULL_KEY: {shm_name, lease_until_ns, digests (hex)}}`, or None when there are no digests."""
    if not digests:
        return None
    return {PULL_KEY: {"shm_name": shm_name, "lease_until_ns": lease_until_ns, "digests": [d.hex() for d in digests]}}


def region_on_host(shm_name: str) -> bool:
    """Whether a kv-sync region of that name attaches on this host."""
    try:
        RegionReader.attach(shm_name).close()
    except NotFound:
        return False
    return True


@dataclass
class StagingPlan:
    """Where one pull's blocks land in the staging region, in digest order: a `Reservation` (the client's
    receive copy writes straight into the slot) or, for a digest already staged, its held slot (leased at
    once, so this pull's reservations cannot evict it) with a scratch buffer for the bytes the stream brings."""

    digests: list[bytes] = field(default_factory=list)
    outs: list[memoryview] = field(default_factory=list)
    slots: list[Reservation | SlotRef] = field(default_factory=list)


class PullStaging:
    """A vLLM worker's staging region for cross-host pulls (a kv-sync `TierRegion` this process owns).

    `reserve` takes a slot per block before the stream (`TierRegion.reserve`: generation odd, unseen by
    readers); `KvSyncClient.pull` assembles each block straight into its slot, the CRC32C computed in that
    copy's pass; `commit` publishes the leading verified blocks with those CRCs (no second copy, no second
    checksum) and leases them, so the connector reads them one-sided like a same-host peer's region and no
    later pull evicts them before the lease ends; every other reservation is aborted. Slots =
    `capacity_bytes // block_bytes` (at least 1); created on first use (the block size is the engine's
    layout), unlinked by `close`.
    """

    def __init__(self, capacity_bytes: int) -> None:
        self.capacity_bytes = capacity_bytes
        self.region: TierRegion | None = None

    @property
    def enabled(self) -> bool:
        return self.capacity_bytes > 0

    def open(self, layout: KvLayout) -> TierRegion:
        if self.region is None:
            slots = max(1, self.capacity_bytes // layout.block_bytes)
            name = region_name(STAGING_TAG)
            self.region = TierRegion.create(name, layout.block_bytes, slots, layout.describe())
            log.info("pull staging region %s: %d slots of %d B", name, slots, layout.block_bytes)
        return self.region

    def reserve(self, digests: Sequence[bytes], until_ns: int) -> StagingPlan:
        """A slot for each leading digest, in order, until one finds none (every slot leased or reserved);
        digests already staged keep their slot, leased until `until_ns` first."""
        region = self.region
        assert region is not None, "open() first"
        refs = region.locate(digests)
        region.lease([r for r in refs if r is not None], until_ns)
        now = time.monotonic_ns()
        plan = StagingPlan()
        for digest, ref in zip(digests, refs, strict=True):
            slot: Reservation | SlotRef | None = ref if ref is not None else region.reserve(digest, now)
            if slot is None:
                break
            plan.digests.append(digest)
            plan.slots.append(slot)
            plan.outs.append(slot.data if isinstance(slot, Reservation) else memoryview(bytearray(region.block_bytes)))
        return plan

    def commit(self, plan: StagingPlan, delivered: PullStats, until_ns: int) -> list[bytes]:
        """Publishes and leases (until `until_ns`) the plan's first `delivered.blocks` blocks with the CRCs
        their copy computed, aborts every other reservation; returns the digests staged."""
        region = self.region
        assert region is not None
        now = time.monotonic_ns()
        keep = delivered.blocks
        staged: list[bytes] = []
        for i, (digest, slot) in enumerate(zip(plan.digests, plan.slots, strict=True)):
            if i < keep and delivered.lengths[i] == 0:  # an empty block is no block: the prefix ends here
                keep = i
            if isinstance(slot, Reservation):
                if i >= keep:
                    region.abort(slot)
                    continue
                slot = region.publish(slot, delivered.lengths[i], delivered.crcs[i], now)
            if i < keep:
                region.lease([slot], until_ns)
                staged.append(digest)
        region.drain_evicted()  # nobody announces the staging region's evictions
        return staged

    def close(self) -> None:
        if self.region is not None:
            self.region.close(unlink=True)
            self.region = None


class VllmPulls:
    """A vLLM worker's pull hints -> `kv_transfer_params` for kvmesh's connector, one lease per request.

    Same host (the hint's region attaches here and `pull_over_shm`): one `AcquireLease` on the source's
    KvSyncService, and the connector reads the leased blocks one-sided from the source's shared memory.
    Otherwise (another host, or `pull_over_shm` false): the blocks are streamed over gRPC (`ReadBlocks`,
    each CRC32C-verified) within the hint's deadline into `staging`, leased there, and the connector reads
    them from the staging region. All network I/O happens here, on the worker's event loop, before vLLM sees
    the request: the connector's scheduler side never waits on the network.

    Any failure (dead peer, timeout, corrupt block, nothing held, an expired hint) means no pull: the request
    is computed. A stream that fails part-way keeps its leading verified blocks (`PullFailed.delivered`):
    those are staged and leased, the rest is computed by vLLM, and no block after the first failed one is
    used. Outcomes (`leased`, `remote`, `remote_partial`, `missing`, `failed`, `expired`,
    `remote_unsupported` when staging is off) are counted in `outcomes` and the outcome metric.
    """

    def __init__(
        self, engine: VllmEngine, peers: PeerPulls, staging: PullStaging, layout: KvLayout | None = None
    ) -> None:
        self.engine = engine
        self.peers = peers
        self.staging = staging
        self.outcomes: Counter[str] = Counter()
        self._kv_layout = layout

    def warm(self) -> None:
        """The KV layout (its import of vLLM's connector API takes seconds) and the staging region, before the
        worker serves: the first pull's deadline must not pay for them."""
        layout = self._layout()
        if self.staging.enabled:
            self.staging.open(layout)

    async def params(self, req: EngineRequest, hint: PullHint) -> dict[str, Any] | None:
        """The request's `kv_transfer_params`, or None (no pull; counted either way)."""
        if hint.expires_unix_ms and hint.expires_unix_ms <= time.time() * 1000:
            return self._outcome("expired", None)
        same_host = self.peers.settings.pull_over_shm and bool(hint.shm_name) and region_on_host(hint.shm_name)
        if not same_host and not self.staging.enabled:
            return self._outcome("remote_unsupported", None)
        timeout_s = self.peers.timeout_ms(hint) / 1000.0
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout_s
        try:
            async with asyncio.timeout_at(deadline):
                limit = min(hint.num_blocks or MAX_BLOCKS, MAX_BLOCKS)  # the hint's prefix, one call
                digests = (list(hint.digests) or await self._digests(req))[:limit]
                if not digests:
                    return self._outcome("missing", None)
                if same_host:
                    return self._leased(hint.shm_name, await self._lease(hint, digests, timeout_s))
                # the stream's own deadline comes first, so its verified prefix is kept (a cancel keeps none)
                left = max(0.001, deadline - loop.time() - STREAM_MARGIN_S)
                return self._staged(*await self._pull_into_staging(hint, digests, left))
        except Exception as e:  # any failure is a recompute, never an error of the request
            log.warning("pull from %s failed, computing instead: %s", hint.source_address, e)
            return self._outcome("failed", None)

    async def _lease(self, hint: PullHint, digests: list[bytes], timeout_s: float) -> Lease:
        return await self.peers.client(hint.source_address).acquire_lease(
            hint.region or TIER_REGION, digests, ttl_ms=self._lease_ms(hint), timeout_s=timeout_s
        )

    async def _pull_into_staging(
        self, hint: PullHint, digests: list[bytes], timeout_s: float
    ) -> tuple[list[bytes], int, bool]:
        """Streams the leading held blocks of `digests` from the source over gRPC (one ReadBlocks, leasing by
        digest there) straight into reserved staging slots, then publishes and leases the leading verified
        ones; returns (the staged digests, their lease's end, whether the stream failed part-way)."""
        layout = self._layout()
        self.staging.open(layout)
        lease_ms = self._lease_ms(hint)
        plan = self.staging.reserve(digests, time.monotonic_ns() + lease_ms * 1_000_000)
        if not plan.digests:  # every staging slot is leased: nothing to pull into
            return [], 0, False
        delivered, partial = PullStats("grpc"), False
        try:
            delivered = await self.peers.client(hint.source_address).pull(
                hint.region or TIER_REGION,
                plan.digests,
                plan.outs,
                layout.describe(),
                ttl_ms=lease_ms,
                timeout_s=timeout_s,
                prefer_shm=False,  # the shared-memory case is the same-host lease above
            )
        except PullFailed as e:
            if not e.blocks:
                raise
            delivered, partial = e.delivered, True
            log.info(
                "pull from %s failed after %d verified blocks, staging those: %s", hint.source_address, e.blocks, e
            )
        finally:  # on any exit, a cancellation too: publish only the verified prefix, free every other slot
            until_ns = time.monotonic_ns() + lease_ms * 1_000_000
            staged = self.staging.commit(plan, delivered, until_ns)
        log.info(
            "pulled %d blocks (%d B) from %s over gRPC into staging", len(staged), delivered.bytes, hint.source_address
        )
        return staged, until_ns, partial

    def _leased(self, shm_name: str, lease: Lease) -> dict[str, Any] | None:
        params = vllm_pull_params(shm_name, lease)
        return self._outcome("leased" if params else "missing", params, len(leased_prefix(lease)))

    def _staged(self, digests: list[bytes], until_ns: int, partial: bool) -> dict[str, Any] | None:
        assert self.staging.region is not None
        params = connector_params(self.staging.region.shm_name, until_ns, digests)
        outcome = ("remote_partial" if partial else "remote") if params else "missing"
        return self._outcome(outcome, params, len(digests))

    def _lease_ms(self, hint: PullHint) -> int:
        return hint.lease_ms or self.peers.settings.pull_lease_ms

    async def _digests(self, req: EngineRequest) -> list[bytes]:
        """The prompt's block identities as the connector computes them (hints without digests)."""
        ids = list(req.prompt_token_ids) if req.prompt_token_ids is not None else None
        if ids is None:
            ids = await self.engine.tokenize(req.prompt or "")
        return block_digests(ids, self._layout(), req.lora_name, req.tenant)

    def _layout(self) -> KvLayout:
        if self._kv_layout is None:  # the front end's config: the same model, dtype and block size as the core's
            from kvmesh.kvplane.vllm_connector.connector import layout_of  # imports vLLM (seconds): only when needed

            self._kv_layout = layout_of(self.engine._llm.vllm_config)
        return self._kv_layout

    def _outcome(self, outcome: str, params: dict[str, Any] | None, blocks: int = 0) -> dict[str, Any] | None:
        self.outcomes[outcome] += 1
        m.observe_pull(blocks)
        m.KV_PULL_OUTCOMES.labels(outcome).inc()
        return params

    def close(self) -> None:
        """Unlinks the staging region."""
        self.staging.close()
