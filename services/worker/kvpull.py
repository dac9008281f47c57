"""The worker's kv-sync glue: its KvSyncService server over its engine's tier, and the peer pulls it makes.

`KvSyncServer` serves the engine's host tier region (`Engine.served_tier`: the simulated engine's own, or the
vLLM connector's, attached read-only, this process being the lessor: `AcquireLease` writes the lease array)
under `TIER_REGION` on a gRPC server of its own (a separate port, so bulk KV streams never queue behind
generation traffic); the address goes into GetInfo. `peer_pulls` builds the engines' `PeerPulls` from the
worker's settings; what an engine does with a pull is `Engine.pull_prefix` (docs/architecture.md, "The pull
path"). The server owns the region's handoff holds (`kvmesh.services.worker.handoff`): it is their lessor.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import Any

import grpc

from kvmesh.kvplane.kvsync import mooncake
from kvmesh.kvplane.kvsync.service import REQUEST_BOUNDS, KvSyncServicer, add_to_server
from kvmesh.kvplane.kvsync.tier import RegionReader, TierRegion
from kvmesh.kvplane.kvsync.transport import exports_mooncake
from kvmesh.kvplane.pulls import TIER_REGION, PeerPulls, PullLimits
from kvmesh.rpc.auth import Guard
from kvmesh.rpc.channel import ChannelSecurity
from kvmesh.rpc.interceptors import InstrumentedServer, MessageBounds
from kvmesh.rpc.tls import server_credentials
from kvmesh.services.worker import metrics as m
from kvmesh.services.worker.handoff import HandoffHolds
from kvmesh.services.worker.settings import WorkerSettings

log = logging.getLogger(__name__)
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
        # the holds of prefill halves on this region: leased here, so they see every peer lease
        self.holds = HandoffHolds(region, TIER_REGION, settings.handoff_hold_ms)
        guard = Guard.from_settings(settings, "kvsync")  # the worker's own table: workers and peer zones only
        offer_mooncake = exports_mooncake(settings.kvsync_transport, guard is not None)
        if offer_mooncake:  # the process's TE publishes the address peers reach this worker at
            mooncake.configure(_advertised_host(settings))
        self.servicer = KvSyncServicer(
            {TIER_REGION: region}, on_lease=self.holds.observe_lease, mooncake=offer_mooncake
        )
        bounds = MessageBounds(per_method=REQUEST_BOUNDS)
        add_to_server(self.servicer, InstrumentedServer(self.server, "kvsync", bounds, guard))
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
        address = f"{_advertised_host(s)}:{self.port}"
        transports = ", ".join(self.servicer.transports(TIER_REGION))
        log.info("kv-sync serving region %r (%s) on %s over %s", TIER_REGION, self.region.shm_name, address, transports)
        return address

    async def stop(self) -> None:
        await self.server.stop(grace=1.0)
        self.servicer.close()  # no peer reads the region through TE once it is unmapped
        self.holds.close()
        if isinstance(self.region, RegionReader):  # an owner's region is closed by its owner
            self.region.close()


def _advertised_host(settings: WorkerSettings) -> str:
    """The host peers reach this worker at."""
    return settings.advertise_address.rsplit(":", 1)[0] if settings.advertise_address else settings.host


def peer_pulls(settings: WorkerSettings) -> PeerPulls:
    """The worker's pulls from its peers: its deadline cap, default lease and transport choice, and its
    outbound channel security."""
    limits = PullLimits(
        settings.pull_timeout_ms, settings.pull_lease_ms, settings.pull_over_shm, settings.kvsync_transport
    )
    carried = lambda outcome: m.KVSYNC_CARRIED_LEASES.labels(outcome).inc()  # noqa: E731
    return PeerPulls(limits, ChannelSecurity.of(settings), carried)
