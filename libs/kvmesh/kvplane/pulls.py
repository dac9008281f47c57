"""Pulls from peers over kv-sync, for any engine: the kv-sync clients a worker keeps per peer, the limits it
puts on a pull, and what a lease on a peer's region offers.

`PeerPulls` is the simulated engine's `pull_transport` (it reads the peer's shared memory when it attaches on
this host, else through Mooncake's Transfer Engine when both workers run one, else streams over gRPC; any
failure raises `PullFailed`, whose verified leading blocks the engine keeps) and the vLLM engine's source of
kv-sync clients (`kvmesh.engine.vllm_pulls`).
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass

import grpc

from kvmesh.core.errors import NotFound
from kvmesh.core.pull import KvPull
from kvmesh.kvplane.kvsync.client import KvSyncClient, Lease
from kvmesh.kvplane.kvsync.tier import RegionReader
from kvmesh.rpc.channel import ChannelSecurity, open_channel

log = logging.getLogger(__name__)
TIER_REGION = "cpu"  # the region name a worker serves its CPU tier under (a pull naming none means it)


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

    def __init__(self, limits: PullLimits, security: ChannelSecurity) -> None:
        self.limits = limits
        self.security = security
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
        stats = await self.client(pull.source_address).pull(
            pull.region or TIER_REGION,
            digests,
            outs,
            layout,
            ttl_ms=self.limits.lease_ms_of(pull),
            timeout_s=self.limits.timeout_ms_of(pull) / 1000.0,
            prefer_shm=self.limits.over_shm,
            transport=self.limits.transport,
        )
        log.debug("pulled %d blocks from %s over %s", stats.blocks, pull.source_address, stats.transport)
        return stats.blocks

    async def close(self) -> None:
        for channel, client in self._clients.values():
            client.close()
            await channel.close()
        self._clients.clear()


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
