"""The router follows the failover service's endpoint sets (`--failover ADDR[,ADDR...]`).

On every `WatchEndpoints` update (`kvmesh.client.watch.EndpointWatcher`, roles WORKER and CACHE_MANAGER):

* workers = the non-critical WORKER endpoints of the router's own zone; if that zone has none, those of
  every other zone (sorted by zone). Static `--workers` addresses always stay. Pool := static ∪ workers:
  new addresses are added (followed at once), vanished ones removed at once — a worker that the registry
  reports critical leaves the passing set, hence the pool, on the next update;
* cache-manager = the first non-critical CACHE_MANAGER of the own zone, else of any zone (sorted by zone, id);
  `--cache-manager` wins when given. A change re-targets the index replica.

`select(endpoints, zone)` is pure; `FailoverFollower` applies it to the pool and the index replica. The
watch uses the router's outbound TLS settings (`security`).
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Sequence

from kvmesh.client.endpoints import EndpointSet
from kvmesh.client.watch import EndpointWatcher
from kvmesh.core.tasks import stop_task
from kvmesh.discovery.model import Health, Role, ServiceInstance
from kvmesh.rpc.channel import ChannelSecurity
from kvmesh.services.router.index_replica import IndexReplica
from kvmesh.services.router.workers import WorkerPool
from kvmesh.v1 import common_pb2

log = logging.getLogger(__name__)

ROLES = (common_pb2.SERVICE_ROLE_WORKER, common_pb2.SERVICE_ROLE_CACHE_MANAGER)


def _zone_first(insts: Sequence[ServiceInstance], zone: str) -> list[ServiceInstance]:
    """Instances of `zone` if any, else all others; sorted by (zone, id)."""
    own = [i for i in insts if i.zone == zone]
    return sorted(own or insts, key=lambda i: (i.zone, i.id))


def select(endpoints: EndpointSet, zone: str) -> tuple[list[str], str]:
    """(worker addresses, cache-manager address or '') for a router of `zone`; critical endpoints excluded."""
    live = [i for i in endpoints.instances if i.health is not Health.CRITICAL]
    workers = _zone_first([i for i in live if i.role is Role.WORKER], zone)
    cms = _zone_first([i for i in live if i.role is Role.CACHE_MANAGER], zone)
    return [i.target for i in workers], (cms[0].target if cms else "")


class FailoverFollower:
    """Keeps the pool and the index replica equal to what the failover service says."""

    def __init__(
        self,
        targets: Sequence[str],
        zone: str,
        pool: WorkerPool,
        index: IndexReplica,
        static_workers: Sequence[str] = (),
        static_cache_manager: str = "",
        security: ChannelSecurity | None = None,
    ) -> None:
        self.zone = zone
        self.pool = pool
        self.index = index
        self.static_workers = set(static_workers)
        self.static_cache_manager = static_cache_manager
        self.watcher = EndpointWatcher(list(targets), roles=ROLES, zone=zone, security=security)
        self.applied = 0  # updates applied so far
        self.first = asyncio.Event()
        self._task: asyncio.Task[None] | None = None

    async def start(self) -> None:
        await self.watcher.start()
        self._task = asyncio.create_task(self._run())

    async def stop(self) -> None:
        await stop_task(self._task)
        await self.watcher.stop()

    async def apply(self, endpoints: EndpointSet) -> None:
        workers, cm = select(endpoints, self.zone)
        want = self.static_workers | set(workers)
        have = self.pool.addresses()
        for a in sorted(have - want):
            self.pool.remove(a)
        for a in workers:
            if a not in have:
                self.pool.add(a)
                log.info("worker %s added from the endpoint sets", a)
        if not self.static_cache_manager and cm:
            await self.index.set_address(cm)
        self.applied += 1
        self.first.set()

    async def _run(self) -> None:
        seen = 0
        while True:
            n = await self.watcher.wait_update(seen, 5.0)
            if n != seen:
                seen = n
                try:
                    await self.apply(self.watcher.current)
                except Exception:
                    log.exception("applying endpoint sets failed")
