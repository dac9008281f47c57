"""Prometheus metrics of the failover service."""

from __future__ import annotations

from prometheus_client import Counter, Gauge, Histogram

ZONE_HEALTHY = Gauge("kvmesh_failover_zone_healthy", "1 when the zone can serve (after hysteresis)", ["zone"])
ZONE_WEIGHT = Gauge("kvmesh_failover_zone_weight", "Share of traffic sent to the zone", ["zone"])
VERSION_WEIGHT = Gauge("kvmesh_failover_version_weight", "Share of traffic sent to the version", ["version"])
ENDPOINTS = Gauge("kvmesh_failover_endpoints", "Up endpoints per zone and role", ["zone", "role"])
SWITCHOVERS = Counter("kvmesh_failover_switchovers_total", "Zone state flips", ["zone", "direction"])
SWITCHOVER_SECONDS = Histogram(
    "kvmesh_failover_switchover_seconds",
    "From the first observation of a zone change to the flip",
    ["direction"],
    buckets=(0, 0.1, 0.25, 0.5, 1, 2, 3, 5, 10, 30, 60, 120),
)
ZONE_REWARM_HOLD = Gauge(
    "kvmesh_failover_zone_rewarm_hold",
    "1 while a restored zone is held at the ramp floor for other zones to re-warm it",
    ["zone"],
)
REWARM_HOLD_SECONDS = Histogram(
    "kvmesh_failover_rewarm_hold_seconds",
    "From a zone's restore to the start of its ramp (its re-warm, or the timeout)",
    ["outcome"],
    buckets=(0, 0.5, 1, 2, 3, 5, 10, 20, 30, 60, 120, 300),
)
REGISTRY_REACHABLE = Gauge("kvmesh_failover_registry_reachable", "1 when the registry (Consul) answers")
SERVING_STALE = Gauge("kvmesh_failover_serving_last_known_good", "1 when serving last-known-good endpoints")
REVISION = Gauge("kvmesh_failover_revision", "Revision of the published endpoint sets")

ROLLOUT_STEP = Gauge("kvmesh_rollout_step_pct", "Traffic share of the version being rolled out, percent", ["version"])
ROLLOUT_VERDICTS = Counter(
    "kvmesh_rollout_verdicts_total",
    "Canary checks by result and failed check (none: passed)",
    ["result", "check"],
)
ROLLOUT_ROLLBACKS = Counter("kvmesh_rollout_rollbacks_total", "Automatic rollbacks by (first) failed check", ["reason"])
ROLLOUT_PROMOTIONS = Counter("kvmesh_rollout_promotions_total", "Rollouts that reached 100 %")
ROLLOUT_CONSISTENCY = Gauge("kvmesh_rollout_consistency", "Mean output-histogram cosine of the last canary check")
ROLLOUT_LATENCY_REGRESSION = Gauge(
    "kvmesh_rollout_latency_regression", "Relative median probe latency change of the last canary check"
)
