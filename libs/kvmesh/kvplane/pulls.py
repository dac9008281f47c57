"""Pulls from peers over kv-sync, for any engine: the kv-sync clients a worker keeps per peer, the limits it
puts on a pull, and what a lease on a peer's region offers.

`PeerPulls` is the simulated engine's `pull_transport` (it reads the peer's shared memory when it attaches on
this host, else through Mooncake's Transfer Engine when both workers run one, else streams over gRPC; any
failure raises `PullFailed`, whose verified leading blocks the engine keeps) and the vLLM engine's source of
kv-sync clients (`kvmesh.engine.vllm_pulls`).

A pull may carry a lease someone else took on the source (`KvPull.lease`: a replicated prefix's, leased by
its cache-manager next to the source worker, `carry` below): the pull then reads under it, skipping its own
`AcquireLease` (over Mooncake across a zone link, one round trip instead of two). The carried lease is used
only when it still has `CARRIED_LEASE_MARGIN_S` to run on this host's clock, covers the blocks the pull
needs, and names the region the source describes now; otherwise, or when the read under it finds the slots
moved on (stale, expired) before any block arrived, the worker leases itself as without one: a carried lease
never fails a pull that would have worked. Each pull carrying one counts its outcome (`carried`, and the
worker's `kvmesh_kvsync_carried_leases_total`): used, expired, mismatch (other blocks or region), stale.
"""

from __future__ import annotations

import logging
import time
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import grpc

from kvmesh.core.errors import NotFound
from kvmesh.core.pull import CarriedLease, KvPull
from kvmesh.kvplane.kvsync.client import KvSyncClient, Lease, PullFailed, PullStats
from kvmesh.kvplane.kvsync.tier import RegionReader, SlotRef
from kvmesh.rpc.channel import ChannelSecurity, open_channel

log = logging.getLogger(__name__)
TIER_REGION = "cpu"  # the region name a worker serves its CPU tier under (a pull naming none means it)
# A carried lease is taken to end this long before its `expires_unix_ms`: the wall clocks of the leasing and
# the reading host differ (NTP keeps them well within this), and a read must finish before the source may
# reuse the slots. Against a lease of seconds (the cache-manager's --replication-lease-ms) it costs nothing.
CARRIED_LEASE_MARGIN_S = 1.0
USED, EXPIRED, MISMATCH, STALE = "used", "expired", "mismatch", "stale"


@dataclass(frozen=True, slots=True)
class PullLimits:
    """A worker's own bounds on the pulls it makes: the deadline cap and the lease asked for when a pull
    names none, in ms, whether a same-host peer is read through shared memory, and the transport choice
    (`kvmesh.kvplane.kvsync.transport`: auto, shm, mooncake or grpc)."""

    timeout_ms: int
    lease_ms: int
    over_shm: bool = True
    transport: str = "auto"

    def timeout_ms_of(self, pull: KvPull) -> int:
        """The pull's deadline: its own, capped by this worker's."""
        return min(pull.timeout_ms or self.timeout_ms, self.timeout_ms)

    def lease_ms_of(self, pull: KvPull) -> int:
        return pull.lease_ms or self.lease_ms


class PeerPulls:
    """One `KvSyncClient` per peer address (channels with this worker's security), and the limits."""

    def __init__(
        self, limits: PullLimits, security: ChannelSecurity, observe_carried: Callable[[str], None] | None = None
    ) -> None:
        self.limits = limits
        self.security = security
        self.carried: Counter[str] = Counter()  # pulls that carried a lease, by outcome (see the module docstring)
        self._observe_carried = observe_carried
        self._clients: dict[str, tuple[grpc.aio.Channel, KvSyncClient]] = {}

    def client(self, address: str) -> KvSyncClient:
        entry = self._clients.get(address)
        if entry is None:
            channel = open_channel(address, self.security, propagate=False)
            entry = self._clients[address] = (channel, KvSyncClient(channel))
        return entry[1]

    async def __call__(self, pull: KvPull, digests: Sequence[bytes], outs: Sequence[memoryview], layout: str) -> int:
        """The leading blocks copied and verified into `outs`; raises `PullFailed` (its `blocks`: the leading
        ones verified before the failure, which the engine keeps)."""
        timeout_s = self.limits.timeout_ms_of(pull) / 1000.0
        stats = await self.pull(pull, digests, outs, layout, timeout_s, self.limits.over_shm)
        log.debug("pulled %d blocks from %s over %s", stats.blocks, pull.source_address, stats.transport)
        return stats.blocks

    async def pull(
        self,
        pull: KvPull,
        digests: Sequence[bytes],
        outs: Sequence[memoryview],
        layout: str,
        timeout_s: float,
        prefer_shm: bool,
    ) -> PullStats:
        """`KvSyncClient.pull` of `digests` from the pull's source within `timeout_s`, under the pull's
        carried lease when it fits (see the module docstring), else under one of its own."""
        client = self.client(pull.source_address)
        region = pull.region or TIER_REGION
        start = time.monotonic()

        async def run(lease: Lease | None, budget_s: float) -> PullStats:
            return await client.pull(
                region,
                digests,
                outs,
                layout,
                ttl_ms=self.limits.lease_ms_of(pull),
                timeout_s=budget_s,
                prefer_shm=prefer_shm,
                lease=lease,
                transport=self.limits.transport,
            )

        left = lambda: timeout_s - (time.monotonic() - start)  # noqa: E731
        carried = await self._carried(client, region, pull, digests, timeout_s)
        if carried is None:
            return await run(None, max(0.001, left()))
        try:
            stats = await run(carried, max(0.001, left()))
        except PullFailed as e:
            if e.reason not in (STALE, EXPIRED) or e.blocks or left() <= 0.001:
                self._count(USED)
                raise
            # the slots moved on (the source restarted or reused them): its lease was the wrong one
            self._count(STALE)
            log.info("carried lease from %s unusable (%s), leasing again", pull.source_address, e)
            return await run(None, left())
        self._count(USED)
        return stats

    async def _carried(
        self, client: KvSyncClient, region: str, pull: KvPull, digests: Sequence[bytes], timeout_s: float
    ) -> Lease | None:
        """The pull's carried lease as this process's `Lease` of `digests`, or None (counted) when it cannot
        serve: ended (within the margin), for other blocks, or for a region other than the one described."""
        if pull.lease is None:
            return None
        lease, unusable = held_lease(pull.lease, tuple(digests), region, time.time(), time.monotonic())
        if lease is None:
            self._count(unusable)
            return None
        try:
            info = await client.describe(region, timeout_s)
        except grpc.aio.AioRpcError:
            return None  # the pull's own Describe fails the same way: no outcome to count
        if info.region_id != lease.region_id:
            self._count(MISMATCH)
            return None
        return lease

    def _count(self, outcome: str) -> None:
        self.carried[outcome] += 1
        if self._observe_carried is not None:
            self._observe_carried(outcome)

    async def close(self) -> None:
        for channel, client in self._clients.values():
            client.close()
            await channel.close()
        self._clients.clear()


def carry(lease: Lease, wall_now: float, mono_now: float) -> CarriedLease:
    """`lease` as it travels to another host (`KvPull.lease`): its end moved from this process's monotonic
    clock (`mono_now` on it) to the wall clock (`wall_now`, Unix seconds, at the same moment)."""
    return CarriedLease(
        digests=tuple(lease.digests),
        slots=tuple((r.slot, r.generation) if r is not None else None for r in lease.refs),
        region_id=lease.region_id,
        expires_unix_ms=int((wall_now + lease.deadline - mono_now) * 1000),
    )


def held_lease(
    carried: CarriedLease, digests: tuple[bytes, ...], region: str, wall_now: float, mono_now: float
) -> tuple[Lease | None, str]:
    """A carried lease as this process's `Lease` of `digests` (its end on this process's monotonic clock,
    `mono_now` on it at wall time `wall_now`, `CARRIED_LEASE_MARGIN_S` early), or (None, why not): `MISMATCH`
    when it is for other blocks, `EXPIRED` when the margin leaves it no time. Pure."""
    slots = carried.covering(digests)
    if slots is None:
        return None, MISMATCH
    left_s = (carried.expires_unix_ms / 1000.0 - wall_now) - CARRIED_LEASE_MARGIN_S
    if left_s <= 0:
        return None, EXPIRED
    deadline = mono_now + left_s
    refs = [SlotRef(*s) if s is not None else None for s in slots]
    # lease_until_ns is what a same-host shared-memory read checks: the same end, on time.monotonic_ns()
    return Lease(region, list(digests), refs, int(deadline * 1e9), deadline, carried.region_id), ""


def leased_prefix(lease: Lease) -> list[bytes]:
    """The digests of the lease's leading held blocks (what a pull can load)."""
    return lease.digests[: lease.prefix]


def leased_pull(shm_name: str, lease_until_ns: int, digests: Sequence[bytes]) -> KvPull | None:
    """The pull a KV connector loads from region `shm_name`: the blocks `digests`, leased there until
    `lease_until_ns` (the connector claims nothing else); None when there are none."""
    if not digests:
        return None
    return KvPull(shm_name=shm_name, num_blocks=len(digests), digests=tuple(digests), lease_until_ns=lease_until_ns)


def region_on_host(shm_name: str) -> bool:
    """Whether a kv-sync region of that name attaches on this host."""
    try:
        RegionReader.attach(shm_name).close()
    except NotFound:
        return False
    return True
