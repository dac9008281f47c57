"""Follows ``FailoverService.WatchEndpoints`` on any of several (equivalent) failover services.

The watcher keeps the latest `EndpointSet`; when a stream breaks it moves to the next failover
address (round-robin) after ``min(retry_max_s, retry_min_s * 2**k)`` and keeps the last set in the
meantime, so clients and routers keep working while every failover service is down. Channels honour
`security` (`kvmesh.rpc.channel.ChannelSecurity` or a `ServerSettings`): TLS to a TLS-only failover service.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Sequence

import grpc
import grpc.aio

from kvmesh.client.endpoints import EndpointSet
from kvmesh.core.changes import ChangeCounter
from kvmesh.core.tasks import stop_task
from kvmesh.rpc.channel import LIVENESS_OPTIONS, ChannelSecurity, open_channel
from kvmesh.v1 import failover_pb2, failover_pb2_grpc

log = logging.getLogger(__name__)


class EndpointWatcher:
    def __init__(
        self,
        failover_targets: Sequence[str],
        *,
        initial: EndpointSet | None = None,
        roles: Sequence[int] = (),
        zone: str = "",
        retry_min_s: float = 0.05,
        retry_max_s: float = 1.0,
        security: ChannelSecurity | None = None,
    ) -> None:
        if not failover_targets and initial is None:
            raise ValueError("need failover targets or an initial endpoint set")
        self.targets = list(failover_targets)
        self.current = initial or EndpointSet(0, (), {}, {})
        self.roles = list(roles)
        self.zone = zone
        self.retry_min_s = retry_min_s
        self.retry_max_s = retry_max_s
        self.security = security or ChannelSecurity()
        self.connected_to: str | None = None
        self._changes = ChangeCounter()
        self._task: asyncio.Task[None] | None = None

    async def start(self) -> None:
        if self.targets:
            self._task = asyncio.create_task(self._run())

    async def stop(self) -> None:
        if self._task:
            await stop_task(self._task)

    @property
    def updates(self) -> int:
        """Endpoint sets received so far."""
        return self._changes.value

    async def wait_update(self, seen: int, timeout_s: float) -> int:
        """Wait until `updates` differs from `seen` (bounded by `timeout_s`); returns the current count."""
        return await self._changes.wait_changed(seen, timeout_s)

    async def _run(self) -> None:
        k = 0
        failures = 0
        while True:
            target = self.targets[k % len(self.targets)]
            k += 1
            try:
                async with open_channel(target, self.security, options=LIVENESS_OPTIONS, propagate=False) as ch:
                    stub = failover_pb2_grpc.FailoverServiceStub(ch)
                    req = failover_pb2.WatchEndpointsRequest(roles=self.roles, zone=self.zone)  # type: ignore[arg-type]
                    async for resp in stub.WatchEndpoints(req, wait_for_ready=False):
                        self.connected_to, failures = target, 0
                        self.current = EndpointSet.from_response(resp)
                        self._changes.bump()
            except grpc.aio.AioRpcError as e:
                log.info("endpoint watch on %s ended: %s", target, e.code().name)
            self.connected_to = None
            failures += 1
            await asyncio.sleep(min(self.retry_max_s, self.retry_min_s * 2 ** min(failures - 1, 10)))
