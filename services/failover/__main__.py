"""Entry point: `python -m kvmesh.services.failover` / `kvmesh-failover`.

Wiring: registry (Consul with --consul-url, else the static YAML --registry-file, else a static file
in a temporary directory; a static one wrapped in `ProbedRegistry`, which probes each instance's gRPC
health, unless --static-probe-interval-s 0) → DiscoveryWatcher (+ last-known-good file) → FailoverPolicy
→ endpoint-set publisher → servicer, with the canary rollout controller (rollout.py) driving version
weights through that publisher. The runner registers the service (role failover, gRPC check) in that
registry, in Consul through the shared default, and deregisters it on SIGTERM.
"""

from __future__ import annotations

import logging
import math
import sys
import tempfile
from collections.abc import Sequence
from pathlib import Path

from kvmesh.core.errors import InvalidArgument
from kvmesh.discovery.checks import ProbePolicy
from kvmesh.discovery.consul import ConsulRegistry
from kvmesh.discovery.lkg import LastKnownGood
from kvmesh.discovery.policy import FailoverPolicy
from kvmesh.discovery.probing import PROBE_CHANNEL_OPTIONS, ProbedRegistry
from kvmesh.discovery.registration import parse_weights, registry_from
from kvmesh.discovery.registry import CheckSpec
from kvmesh.discovery.static import StaticRegistry
from kvmesh.discovery.watcher import DiscoveryWatcher
from kvmesh.discovery.zones import ZonePolicy
from kvmesh.ops.rollout.canary import CanaryThresholds, probe_prompts
from kvmesh.ops.rollout.schedule import RolloutPlan, parse_steps
from kvmesh.rpc.channel import CHANNEL_OPTIONS, open_channel
from kvmesh.rpc.server import ServiceRunner, run_service
from kvmesh.services.failover.canary_probe import VersionProber
from kvmesh.services.failover.endpoint_sets import EndpointSetPublisher
from kvmesh.services.failover.rollout import RolloutController
from kvmesh.services.failover.servicer import FailoverServicer
from kvmesh.services.failover.settings import FailoverSettings
from kvmesh.v1 import failover_pb2_grpc

log = logging.getLogger(__name__)


def make_policy(s: FailoverSettings) -> FailoverPolicy:
    zp = ZonePolicy(
        min_worker_fraction=s.min_worker_fraction,
        require_cache_manager=s.require_cache_manager,
        up_observations=s.up_observations,
        up_hold_s=s.up_hold_s,
        min_dwell_s=s.min_dwell_s,
        ramp_s=s.ramp_s,
        rewarm_timeout_s=s.rewarm_timeout_s,
        start_grace_s=s.start_grace_s,
    )
    if s.zone_weights:
        zw, default = parse_weights("zone_weights", s.zone_weights), 0.0
    else:  # equal weights, also for zones discovered later
        zones = s.zones or [s.zone]
        zw = {z: 1.0 / len(zones) for z in zones}
        default = 1.0 / len(zones)
    vw = parse_weights("version_weights", s.version_weights) if s.version_weights else {s.version: 1.0}
    return FailoverPolicy.create(zp, zw, vw, s.zones, default_zone_weight=default)


def probed(registry: StaticRegistry, s: FailoverSettings) -> ProbedRegistry:
    """`registry` with its instances' health from gRPC health probes (a static file runs no checks)."""
    policy = ProbePolicy(
        s.static_probe_interval_s, s.static_probe_timeout_s, s.static_probe_failures, s.static_probe_successes
    )
    options = [*CHANNEL_OPTIONS, *PROBE_CHANNEL_OPTIONS]
    return ProbedRegistry(registry, policy, lambda target: open_channel(target, s, options=options, propagate=False))


def make_rollouts(publisher: EndpointSetPublisher, s: FailoverSettings) -> RolloutController:
    """The canary rollout controller from the rollout_* settings (InvalidArgument naming a bad one)."""
    if s.rollout_probes < 1 or s.rollout_probe_prompt_tokens < 1 or s.rollout_probe_max_tokens < 1:
        raise InvalidArgument("rollout_probes", "rollout_probes, _prompt_tokens and _max_tokens must be >= 1")
    for name in ("rollout_check_interval_s", "rollout_probe_timeout_s"):
        if not 0 < getattr(s, name) < math.inf:
            raise InvalidArgument(name, f"must be a finite number > 0, got {getattr(s, name)}")
    prompts = probe_prompts(s.rollout_probes, s.rollout_probe_prompt_tokens)
    prober = VersionProber(lambda t: open_channel(t, s), prompts, s.rollout_probe_max_tokens, s.rollout_probe_timeout_s)
    plan = RolloutPlan(parse_steps(s.rollout_steps), s.rollout_hold_s, s.rollout_standby_s)
    th = CanaryThresholds(
        s.rollout_min_consistency,
        s.rollout_max_latency_regression,
        s.rollout_max_memory_diff,
        s.rollout_max_error_rate_increase,
    )
    return RolloutController(publisher, prober, plan, th, s.rollout_check_interval_s)


async def build(runner: ServiceRunner, settings: FailoverSettings) -> None:
    """Wires the failover servicer into the runner."""
    registry = registry_from(settings.registry_file, settings.consul_url, settings.registry_timeout_s)
    if registry is None:
        path = Path(tempfile.mkdtemp(prefix="kvmesh-failover-")) / "registry.yaml"
        log.warning("no --consul-url or --registry-file: static registry at %s", path)
        registry = StaticRegistry(path)
    static = registry if isinstance(registry, StaticRegistry) else None
    if static is not None and settings.static_probe_interval_s > 0:
        prober = probed(static, settings)
        await prober.start()
        registry = prober
    lkg = LastKnownGood(settings.lkg_file) if settings.lkg_file else None
    watcher = DiscoveryWatcher(registry, lkg, wait_s=settings.watch_wait_s, retry_max_s=1.0)
    await watcher.start()
    publisher = EndpointSetPublisher(watcher, make_policy(settings), tick_s=settings.health_interval_s)
    await publisher.start()
    rollouts = make_rollouts(publisher, settings)
    runner.add_servicer(
        failover_pb2_grpc.add_FailoverServiceServicer_to_server,
        FailoverServicer(publisher, registry, runner.stopping, rollouts),
        "kvmesh.v1.FailoverService",
    )
    if not settings.consul_url:  # with Consul the runner's default registration applies
        check = CheckSpec(interval_s=settings.check_interval_s, timeout_s=settings.check_interval_s)
        runner.register_in(static or registry, check, advertise_host=settings.advertise_host)

    async def stopped() -> None:
        await rollouts.stop()
        await publisher.stop()
        await watcher.stop()
        if isinstance(registry, ConsulRegistry):
            await registry.close(deregister=False)
        else:
            await registry.close()

    runner.on_stopped.append(stopped)


def main(argv: Sequence[str] | None = None) -> int:
    return run_service("failover", FailoverSettings, build, argv)


if __name__ == "__main__":
    sys.exit(main())
