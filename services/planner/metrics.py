"""Planner metrics (the service skeleton's /metrics serves them)."""

from __future__ import annotations

from prometheus_client import Counter, Gauge

DESIRED = Gauge("kvmesh_planner_desired_workers", "Workers the forecast asks for", ["zone"])
SERVING = Gauge("kvmesh_planner_serving_workers", "Workers taking traffic", ["zone"])
STARTING = Gauge("kvmesh_planner_starting_workers", "Workers started and not yet serving", ["zone"])
FORECAST_RPS = Gauge("kvmesh_planner_forecast_rps", "Highest forecast request rate within lead_s", ["zone"])
FORECASTER = Gauge("kvmesh_planner_forecaster", "1 for the forecaster the planner trusts", ["zone", "forecaster"])
FORECAST_MAE = Gauge(
    "kvmesh_planner_forecast_mae", "Held-out MAE of each forecaster (requests per bucket)", ["zone", "forecaster"]
)
ACTIONS = Counter("kvmesh_planner_actions_total", "Scaling actions carried out", ["zone", "action"])
STEP_ERRORS = Counter(
    "kvmesh_planner_step_errors_total", "Planning steps that failed (router unreachable, ...)", ["zone"]
)
POOL_DESIRED = Gauge(
    "kvmesh_planner_pool_desired_workers",
    "A disaggregated zone's workers the forecast asks for, per pool",
    ["zone", "role"],
)
POOL_SERVING = Gauge(
    "kvmesh_planner_pool_serving_workers", "A disaggregated zone's workers taking traffic, per pool", ["zone", "role"]
)
