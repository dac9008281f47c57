"""Entry point: `python -m kvmesh.services.planner` / `kvmesh-planner`.

Wiring: one :class:`~kvmesh.ops.planner.zone.ZonePlanner` per zone of ``--routers`` (the sizing rules from the
settings), the actuator (``--actuator dry-run|local|kubernetes``), the history checkpoint
(``--history-file``, loaded at start), and the planning step every ``--interval-s`` on the service
skeleton's background tasks; `PlannerService/GetPlan` serves what it forecast and decided (role admin). The
planner calls the routers' admin RPCs (ListWorkers, DrainWorker): with the authorisation table enforced, give
it a token or certificate of role planner (or admin). It does not register itself in Consul.
"""

from __future__ import annotations

import logging
import sys
from collections.abc import Sequence

from kvmesh.core.errors import InvalidArgument
from kvmesh.ops.planner.pools import PoolPolicy
from kvmesh.ops.planner.sizing import SizingPolicy
from kvmesh.ops.planner.zone import PlannerConfig, ZonePlanner
from kvmesh.rpc.server import ServiceRunner, run_service
from kvmesh.services.planner.actuators import make_actuator
from kvmesh.services.planner.loop import PlannerLoop
from kvmesh.services.planner.servicer import PlannerServicer
from kvmesh.services.planner.settings import PlannerSettings, zone_map
from kvmesh.v1 import planner_pb2_grpc

log = logging.getLogger(__name__)


def planner_config(s: PlannerSettings) -> PlannerConfig:
    if s.interval_s <= 0 or s.bucket_s <= 0 or s.horizon_buckets < 1:
        raise InvalidArgument("interval_s", "interval_s and bucket_s must be > 0 and horizon_buckets >= 1")
    try:
        sizing = SizingPolicy(
            per_worker_rps=s.per_worker_rps,
            buffer=s.buffer,
            lead_s=s.lead_s,
            min_workers=s.min_workers,
            max_workers=s.max_workers,
            min_lifetime_s=s.min_lifetime_s,
            scale_in_delay_s=s.scale_in_delay_s,
            scale_in_cooldown_s=s.scale_in_cooldown_s,
            scale_in_step=s.scale_in_step,
            queue_scale_out=s.queue_scale_out,
        )
    except ValueError as e:
        raise InvalidArgument("sizing", str(e)) from e
    return PlannerConfig(
        sizing,
        s.bucket_s,
        s.horizon_buckets,
        s.retrain_s,
        lstm_epochs=s.lstm_epochs,
        average_window_s=s.average_window_s,
        pools=pool_policy(s) if s.pools else None,
    )


def pool_policy(s: PlannerSettings) -> PoolPolicy:
    """The `--pools` capacity model from the settings; InvalidArgument naming the setting for a bad value."""
    try:
        return PoolPolicy(
            prompt_tokens_per_request=s.prompt_tokens_per_request,
            output_tokens_per_request=s.output_tokens_per_request,
            prefill_tokens_per_s=s.prefill_worker_tokens_per_s,
            decode_streams=s.decode_worker_streams,
            itl_s=s.itl_target_ms / 1000.0,
            buffer=s.buffer,
            min_prefill=s.min_prefill_workers,
            min_decode=s.min_decode_workers,
            split_delay_s=s.split_delay_s,
        )
    except ValueError as e:
        name = str(e).split(" ", 1)[0]  # PoolPolicy's field, named first
        raise InvalidArgument(POOL_SETTINGS.get(name, name), str(e)) from e


POOL_SETTINGS = {  # PoolPolicy's field → the setting it comes from (where the names differ)
    "prefill_tokens_per_s": "prefill_worker_tokens_per_s",
    "decode_streams": "decode_worker_streams",
    "itl_s": "itl_target_ms",
    "min_prefill": "min_prefill_workers",
    "min_decode": "min_decode_workers",
}


async def build(runner: ServiceRunner, settings: PlannerSettings) -> None:
    if settings.consul_url:
        raise InvalidArgument("consul_url", "the planner does not register in Consul: give it --routers")
    routers = zone_map("routers", settings.routers, "host:port")
    config = planner_config(settings)
    actuator = make_actuator(settings)
    loop = PlannerLoop(
        {z: ZonePlanner.create(config) for z in routers},
        routers,
        actuator,
        settings,
        settings.history_file,
        settings.drain_timeout_s,
    )
    loop.restore()
    runner.add_servicer(
        planner_pb2_grpc.add_PlannerServiceServicer_to_server,
        PlannerServicer(loop, actuator.name, settings.interval_s),
        "kvmesh.v1.PlannerService",
    )
    runner.every(settings.interval_s, loop.step, name="plan")
    runner.on_stopping.append(loop.close)
    log.info("planning zones %s with the %s actuator", sorted(routers), actuator.name)


def main(argv: Sequence[str] | None = None) -> int:
    return run_service("planner", PlannerSettings, build, argv)


if __name__ == "__main__":
    sys.exit(main())
