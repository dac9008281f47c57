"""The worker's data plane: its KvSyncService server over its CPU tier, and pulls from peers.

`KvSyncServer` serves the engine's CPU tier region (`TIER_REGION`) on a gRPC server of its own (a separate
port, so bulk KV streams never queue behind generation traffic); the address goes into GetInfo. `PeerPulls`
is the simulated engine's `pull_transport`: one `KvSyncClient` per peer address, which reads the peer's
shared memory when it attaches here and streams over gRPC otherwise; any failure raises `PullFailed`.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import Any

import grpc

from kvmesh.engine.sim.tiers import PullHint
from kvmesh.kvsync.client import KvSyncClient
from kvmesh.kvsync.service import REQUEST_BOUNDS, KvSyncServicer, add_to_server
from kvmesh.kvsync.tier import TierRegion
from kvmesh.rpc.channel import open_channel
from kvmesh.rpc.interceptors import InstrumentedServer, MessageBounds
from kvmesh.rpc.tls import server_credentials
from kvmesh.services.worker.settings import WorkerSettings
from kvmesh.v1 import worker_pb2

log = logging.getLogger(__name__)
TIER_REGION = "cpu"
_SERVER_OPTIONS: Sequence[tuple[str, Any]] = (
    ("grpc.max_receive_message_length", 8 << 20),
    ("grpc.max_send_message_length", 64 << 20),
)


class KvSyncServer:
    """KvSyncService over one CPU tier region, on its own port."""

    def __init__(self, region: TierRegion, settings: WorkerSettings) -> None:
        self.region = region
        self.settings = settings
        self.server = grpc.aio.server(options=list(_SERVER_OPTIONS))
        servicer = KvSyncServicer({TIER_REGION: region})
        add_to_server(servicer, InstrumentedServer(self.server, "kvsync", MessageBounds(per_method=REQUEST_BOUNDS)))
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


class PeerPulls:
    """`pull_transport` of the simulated engine: pulls from the peers hints name (clients kept per address)."""

    def __init__(self, settings: WorkerSettings) -> None:
        self.settings = settings
        self._clients: dict[str, tuple[grpc.aio.Channel, KvSyncClient]] = {}

    def _client(self, address: str) -> KvSyncClient:
        entry = self._clients.get(address)
        if entry is None:
            channel = open_channel(address, self.settings, propagate=False)
            entry = self._clients[address] = (channel, KvSyncClient(channel))
        return entry[1]

    async def __call__(self, hint: PullHint, digests: Sequence[bytes], outs: Sequence[memoryview], layout: str) -> int:
        s = self.settings
        timeout_ms = min(hint.timeout_ms or s.pull_timeout_ms, s.pull_timeout_ms)
        stats = await self._client(hint.source_address).pull(
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
