"""Static-registry instances probed over ``grpc.health.v1`` (the edge around `kvmesh.discovery.checks`).

`ProbedRegistry(inner, policy, open_channel)` is a `Registry` over another one (the static YAML registry).
It follows the inner registry's watch and, every ``policy.interval_s``, calls ``Health/Check`` (service
``""``) on every instance at once, each call bounded by ``policy.timeout_s``; a reply other than SERVING, an
error or a timeout is a failed probe. It serves the inner snapshot with the probed health
(`checks.probed_snapshot`), under a local index that increases whenever what it serves changes, so `watch`
returns as soon as an instance turns critical or passing. Register / deregister go to the inner registry.
Consul-backed discovery does not use this: Consul's own checks apply there.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Callable

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from kvmesh.core.changes import ChangeCounter
from kvmesh.core.errors import KvmeshError
from kvmesh.core.tasks import stop_task
from kvmesh.discovery.checks import ProbePolicy, ProbeState, probed_snapshot, step_probe
from kvmesh.discovery.model import CatalogSnapshot, ServiceInstance
from kvmesh.discovery.registry import CheckSpec, HealthProbe, Registry

log = logging.getLogger(__name__)

ChannelFactory = Callable[[str], grpc.aio.Channel]
"""Opens an aio channel to ``host:port`` (plaintext or TLS, as the caller's own outbound channels)."""

PROBE_CHANNEL_OPTIONS = [
    # a probe must see a restarted instance within a probe or two, not after gRPC's default backoff (up to 120 s)
    ("grpc.initial_reconnect_backoff_ms", 100),
    ("grpc.min_reconnect_backoff_ms", 100),
    ("grpc.max_reconnect_backoff_ms", 1000),
]
"""Channel options a `ChannelFactory` should add for probe channels."""
INNER_WAIT_S = 5.0  # blocking wait of one watch on the inner registry


class ProbedRegistry:
    """`Registry` serving another registry's instances with health from active probes (module docstring)."""

    def __init__(self, inner: Registry, policy: ProbePolicy, open_channel: ChannelFactory) -> None:
        self.inner = inner
        self.policy = policy
        self._open_channel = open_channel
        self._channels: dict[str, grpc.aio.Channel] = {}
        self._inner_index = 0
        self._base = CatalogSnapshot()
        self._states: dict[tuple[str, str], ProbeState] = {}  # by (id, target): a moved instance starts afresh
        self._served = CatalogSnapshot()
        self._changes = ChangeCounter(1)
        self._tasks: list[asyncio.Task[None]] = []

    async def start(self) -> None:
        """Reads the inner registry, then follows it and probes in the background."""
        self._inner_index, self._base = await self.inner.snapshot()
        self._serve()
        self._tasks = [asyncio.create_task(self._follow()), asyncio.create_task(self._probe_loop())]

    # -- Registry ------------------------------------------------------------------------------
    async def register(
        self, instance: ServiceInstance, check: CheckSpec | None = None, probe: HealthProbe | None = None
    ) -> None:
        await self.inner.register(instance, check or CheckSpec(), probe)
        await self._reread()

    async def deregister(self, instance_id: str) -> None:
        await self.inner.deregister(instance_id)
        await self._reread()

    async def snapshot(self) -> tuple[int, CatalogSnapshot]:
        return self._changes.value, self._served

    async def watch(self, index: int, wait_s: float) -> tuple[int, CatalogSnapshot]:
        await self._changes.wait_changed(index, wait_s)
        return self._changes.value, self._served

    async def close(self) -> None:
        for task in self._tasks:
            await stop_task(task)
        self._tasks = []
        for ch in self._channels.values():
            await ch.close()
        self._channels.clear()
        await self.inner.close()

    # -- background ----------------------------------------------------------------------------
    async def _reread(self) -> None:
        self._inner_index, self._base = await self.inner.snapshot()
        self._serve()

    async def _follow(self) -> None:
        while True:
            try:
                self._inner_index, self._base = await self.inner.watch(self._inner_index, INNER_WAIT_S)
            except (KvmeshError, OSError, TimeoutError) as e:
                log.warning("probed registry: inner registry failed, keeping its last content: %s", e)
                await asyncio.sleep(self.policy.interval_s)
                continue
            self._serve()

    async def _probe_loop(self) -> None:
        loop = asyncio.get_running_loop()
        while True:
            began = loop.time()
            await self._probe_round()
            await asyncio.sleep(max(0.0, self.policy.interval_s - (loop.time() - began)))

    async def _probe_round(self) -> None:
        instances = self._base.instances
        results = await asyncio.gather(*(self._probe(i) for i in instances))
        states: dict[tuple[str, str], ProbeState] = {}
        for inst, ok in zip(instances, results, strict=True):
            key = (inst.id, inst.target)
            prev = self._states.get(key, ProbeState())
            states[key] = new = step_probe(prev, ok, self.policy)
            if new.health is not prev.health:
                log.warning(
                    "%s %s (%s) is now %s by its health probes", inst.role.value, inst.id, inst.target, new.health
                )
        self._states = states  # instances gone from the registry are forgotten
        await self._retain_channels({i.target for i in instances})
        self._serve()

    async def _probe(self, inst: ServiceInstance) -> bool:
        channel = self._channels.get(inst.target)
        if channel is None:
            channel = self._channels[inst.target] = self._open_channel(inst.target)
        try:
            reply = await health_pb2_grpc.HealthStub(channel).Check(
                health_pb2.HealthCheckRequest(), timeout=self.policy.timeout_s
            )
        except (grpc.aio.AioRpcError, TimeoutError):
            return False
        return bool(reply.status == health_pb2.HealthCheckResponse.SERVING)

    async def _retain_channels(self, targets: set[str]) -> None:
        for target in [t for t in self._channels if t not in targets]:
            with contextlib.suppress(grpc.RpcError):
                await self._channels.pop(target).close()

    def _serve(self) -> None:
        by_id = {i.id: self._states[(i.id, i.target)] for i in self._base.instances if (i.id, i.target) in self._states}
        served = probed_snapshot(self._base, by_id)
        if served != self._served:
            self._served = served
            self._changes.bump()
