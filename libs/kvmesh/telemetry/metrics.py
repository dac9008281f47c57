"""Prometheus metrics shared by every service (RPC-level). Service-specific metrics live with the service.

Metric names follow `kvmesh_<subsystem>_<name>_<unit>`; every service exposes them on `GET /metrics`.
"""

from __future__ import annotations

import asyncio
import math

from prometheus_client import CONTENT_TYPE_LATEST, Counter, Gauge, Histogram, generate_latest

LATENCY_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60)

RPC_REQUESTS = Counter(
    "kvmesh_rpc_requests_total", "gRPC calls handled, by final status code", ["service", "method", "code"]
)
RPC_LATENCY = Histogram(
    "kvmesh_rpc_latency_seconds",
    "gRPC call duration (streams: until the last message)",
    ["service", "method"],
    buckets=LATENCY_BUCKETS,
)
RPC_IN_FLIGHT = Gauge("kvmesh_rpc_in_flight", "gRPC calls being handled", ["service", "method"])
LOG_RECORDS_SUPPRESSED = Counter(
    "kvmesh_log_records_suppressed_total",
    "Log records dropped by the repeat limit (same logger, level and message template within a window)",
    ["logger", "level"],
)
AUTHZ_DENIED = Counter(
    "kvmesh_authz_denied_total",
    "Calls refused by the authorisation table (UNAUTHENTICATED / PERMISSION_DENIED, HTTP 401 / 403), by the "
    "gRPC method or HTTP route and the caller's role (anonymous: none)",
    ["service", "method", "role"],
)
SERVICE_INFO = Gauge("kvmesh_service_info", "Static service information (value 1)", ["service", "zone", "version"])
ASYNCIO_TASKS = Gauge(
    "kvmesh_asyncio_tasks",
    "asyncio tasks alive in the process's event loop when scraped (a number that only grows is a task leak)",
)


def _live_tasks() -> float:
    """Tasks of the running event loop (/metrics is served on it); NaN when scraped off the loop."""
    try:
        return float(len(asyncio.all_tasks()))
    except RuntimeError:
        return math.nan


ASYNCIO_TASKS.set_function(_live_tasks)


def render_latest() -> tuple[bytes, str]:
    """The Prometheus exposition of the default registry, with its content type."""
    return generate_latest(), CONTENT_TYPE_LATEST
