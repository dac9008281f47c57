"""Settings of the planner (flags and KVMESH_* env, see kvmesh.core.config)."""

from __future__ import annotations

from dataclasses import dataclass

from kvmesh.core.config import ServerSettings, key_map, setting
from kvmesh.core.errors import InvalidArgument


@dataclass(frozen=True)
class PlannerSettings(ServerSettings):
    """kvmesh planner: forecasts each zone's load and scales its workers."""

    routers: tuple[str, ...] = setting((), "gRPC address of each zone's router, 'zone=host:port' (comma list)")
    actuator: str = setting(
        "dry-run", "what carries out a decision: dry-run, local (worker processes), kubernetes (worker Deployments)"
    )
    interval_s: float = setting(60.0, "seconds between planning steps")
    bucket_s: float = setting(300.0, "history bucket, seconds (the forecasters' time step)")
    horizon_buckets: int = setting(12, "buckets forecast ahead (12 x 300 s = the next hour)")
    per_worker_rps: float = setting(
        0.2, "capacity model: requests/s one worker serves within the SLO (measure it: python -m kvmesh.bench fleet)"
    )
    buffer: float = setting(0.2, "headroom over the forecast for bursts (seed 000 §4.3)")
    lead_s: float = setting(1200.0, "the zone is sized for the forecast's peak over this many seconds ahead")
    min_workers: int = setting(2, "warm workers kept in every zone at all times (seed 003 §1.3)")
    max_workers: int = setting(64, "most workers per zone")
    min_lifetime_s: float = setting(1800.0, "a worker is kept at least this long after it starts (seed 000 §4.3)")
    scale_in_delay_s: float = setting(900.0, "the forecast must stay below the fleet this long before a scale-in")
    scale_in_cooldown_s: float = setting(600.0, "seconds between two scale-in steps")
    scale_in_step: int = setting(1, "most workers removed per scale-in step")
    queue_scale_out: int = setting(50, "more requests than this waiting in a zone add a worker at once")
    retrain_s: float = setting(21600.0, "seconds between refits of the forecasters")
    lstm_epochs: int = setting(150, "training epochs of the LSTM")
    average_window_s: float = setting(3600.0, "window of the moving average used until a held-out day exists")
    history_file: str = setting("", "checkpoint of the load history (JSON), written every step; '' = none")
    registry_file: str = setting("", "local actuator: the static registry the failover service reads")
    worker_args: str = setting("", "local actuator: flags of every worker it starts (shell-quoted string)")
    worker_log_dir: str = setting("", "local actuator: where started workers log (default: a temporary directory)")
    kube_deployments: tuple[str, ...] = setting(
        (), "kubernetes actuator: each zone's worker Deployment, 'zone=name' (comma list)"
    )
    kube_api_url: str = setting("", "kubernetes actuator: API server URL ('' = in-cluster, KUBERNETES_SERVICE_HOST)")
    kube_namespace: str = setting("", "kubernetes actuator: namespace of the Deployments ('' = the pod's own)")
    kube_token_file: str = setting("", "kubernetes actuator: bearer token file ('' = the pod's service account)")
    kube_ca_file: str = setting("", "kubernetes actuator: CA of the API server ('' = the service account's)")
    drain_timeout_s: float = setting(120.0, "a draining worker is stopped at the latest this long after its drain")
    pools: bool = setting(
        False,
        "prefill/decode disaggregated zones: size the prefill and decode pools apart (each by its latency target,"
        " kvmesh.ops.planner.pools) and change workers' roles when the split should move",
    )
    prompt_tokens_per_request: float = setting(
        1024.0, "pools: mean prompt tokens a request has prefilled (uncached), for the prefill pool"
    )
    output_tokens_per_request: float = setting(256.0, "pools: mean tokens a request generates, for the decode pool")
    prefill_worker_tokens_per_s: float = setting(
        7000.0, "pools: prompt tokens/s one prefill worker computes with the TTFT target kept (measure it)"
    )
    decode_worker_streams: float = setting(
        64.0, "pools: concurrent streams one decode worker serves with the ITL target kept (measure it)"
    )
    itl_target_ms: float = setting(100.0, "pools: the ITL target, milliseconds per generated token")
    min_prefill_workers: int = setting(1, "pools: prefill workers kept at all times")
    min_decode_workers: int = setting(1, "pools: decode workers kept at all times")
    split_delay_s: float = setting(
        600.0, "pools: a pool must stay short this long before a worker changes role, and role changes this far apart"
    )


def zone_map(field: str, items: tuple[str, ...], what: str) -> dict[str, str]:
    """``('a=X', 'b=Y')`` → {zone: X}: at least one entry, each zone once; InvalidArgument naming ``field``
    (``what`` names the value in the message: ``host:port``, ``deployment``)."""
    out = key_map(field, items, f"zone={what}")
    if not out:
        raise InvalidArgument(field, f"at least one zone={what} is needed")
    return out
