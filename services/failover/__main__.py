"""Entry point: `python -m kvmesh.services.failover` / `kvmesh-failover`.

Wiring: registry (Consul with --consul-url, else the static YAML --registry-file, else a static file
in a temporary directory) → DiscoveryWatcher (+ last-known-good file) → FailoverPolicy → endpoint-set publisher →
servicer. The service registers itself (role failover, gRPC check) and deregisters on SIGTERM.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import sys
import tempfile
from collections.abc import Sequence
from pathlib import Path

from kvmesh.discovery.consul import ConsulRegistry
from kvmesh.discovery.lkg import LastKnownGood
from kvmesh.discovery.model import Role, ServiceInstance
from kvmesh.discovery.policy import FailoverPolicy
from kvmesh.discovery.registration import parse_weights, register_self, registry_from
from kvmesh.discovery.registry import CheckSpec, Registry
from kvmesh.discovery.static import StaticRegistry
from kvmesh.discovery.watcher import DiscoveryWatcher
from kvmesh.discovery.zones import ZonePolicy
from kvmesh.errors import KvmeshError
from kvmesh.rpc.server import BoundPorts, ServiceRunner, run_service
from kvmesh.services.failover.endpoint_sets import EndpointSetPublisher
from kvmesh.services.failover.servicer import FailoverServicer
from kvmesh.services.failover.settings import FailoverSettings
from kvmesh.v1 import failover_pb2_grpc

log = logging.getLogger(__name__)
REGISTER_ATTEMPTS = 30


def make_policy(s: FailoverSettings) -> FailoverPolicy:
    zp = ZonePolicy(
        min_worker_fraction=s.min_worker_fraction,
        require_cache_manager=s.require_cache_manager,
        up_observations=s.up_observations,
        up_hold_s=s.up_hold_s,
        min_dwell_s=s.min_dwell_s,
        ramp_s=s.ramp_s,
    )
    if s.zone_weights:
        zw, default = parse_weights("zone_weights", s.zone_weights), 0.0
    else:  # equal weights, also for zones discovered later
        zones = s.zones or [s.zone]
        zw = {z: 1.0 / len(zones) for z in zones}
        default = 1.0 / len(zones)
    vw = parse_weights("version_weights", s.version_weights) if s.version_weights else {s.version: 1.0}
    return FailoverPolicy.create(zp, zw, vw, s.zones, default_zone_weight=default)


async def _register_self(
    registry: Registry, runner: ServiceRunner, s: FailoverSettings, ports: BoundPorts
) -> ServiceInstance | None:
    """Register with bounded retries (the registry may be down at start; last-known-good still serves)."""
    for attempt in range(REGISTER_ATTEMPTS):
        try:
            return await register_self(
                registry,
                instance_id=runner.service_id,
                role=Role.FAILOVER,
                zone=s.zone,
                version=s.version,
                address=f"{s.advertise_host or ports.host}:{ports.grpc_port}",
                check=CheckSpec(interval_s=s.check_interval_s, timeout_s=s.check_interval_s),
            )
        except (KvmeshError, OSError) as e:
            log.warning("self-registration attempt %d failed: %s", attempt + 1, e)
            if runner.stopping.is_set():
                return None
            await asyncio.sleep(min(5.0, 0.2 * 2**attempt))
    return None


async def build(runner: ServiceRunner, settings: FailoverSettings) -> None:
    """Wires the failover servicer into the runner."""
    registry = registry_from(settings.registry_file, settings.consul_url, settings.registry_timeout_s)
    if registry is None:
        path = Path(tempfile.mkdtemp(prefix="kvmesh-failover-")) / "registry.yaml"
        log.warning("no --consul-url or --registry-file: static registry at %s", path)
        registry = StaticRegistry(path)
    lkg = LastKnownGood(settings.lkg_file) if settings.lkg_file else None
    watcher = DiscoveryWatcher(registry, lkg, wait_s=settings.watch_wait_s, retry_max_s=1.0)
    await watcher.start()
    publisher = EndpointSetPublisher(watcher, make_policy(settings), tick_s=settings.health_interval_s)
    await publisher.start()
    runner.add_servicer(
        failover_pb2_grpc.add_FailoverServiceServicer_to_server,
        FailoverServicer(publisher, registry, runner.stopping),
        "kvmesh.v1.FailoverService",
    )
    me: dict[str, ServiceInstance | None] = {"inst": None}
    tasks: list[asyncio.Task[None]] = []

    async def started(ports: BoundPorts) -> None:
        if settings.consul_url:
            return  # the shared bootstrap registers every service in Consul

        async def reg() -> None:
            me["inst"] = await _register_self(registry, runner, settings, ports)

        tasks.append(asyncio.create_task(reg()))

    async def stopping() -> None:
        for t in tasks:
            t.cancel()
        inst = me["inst"]
        if inst is not None:
            with contextlib.suppress(KvmeshError, OSError, TimeoutError):
                await asyncio.wait_for(registry.deregister(inst.id), 3.0)

    async def stopped() -> None:
        await publisher.stop()
        await watcher.stop()
        if isinstance(registry, ConsulRegistry):
            await registry.close(deregister=False)
        else:
            await registry.close()

    runner.on_started.append(started)
    runner.on_stopping.append(stopping)
    runner.on_stopped.append(stopped)


def main(argv: Sequence[str] | None = None) -> int:
    return run_service("failover", FailoverSettings, build, argv)


if __name__ == "__main__":
    sys.exit(main())
