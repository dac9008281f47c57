"""Service-mesh friendly mode: a plain gRPC channel to a DNS name with a service config.

For clients that only know ``dns:///routers.example:50051``: gRPC resolves every address, balances
with ``round_robin``, drops backends whose ``grpc.health.v1`` status is not SERVING
(``healthCheckConfig``; the routers serve that health service) and retries UNAVAILABLE calls with
exponential back-off (``retryPolicy``; a streaming call is only retried before its first response).
"""

from __future__ import annotations

import json
from typing import Any, cast

import grpc

from kvmesh.rpc.channel import ChannelSecurity, TokenChannel

ROUTER_SERVICE = "kvmesh.v1.RouterService"


def service_config(
    service: str = ROUTER_SERVICE,
    *,
    health_service: str = "",
    max_attempts: int = 4,
    initial_backoff_s: float = 0.1,
    max_backoff_s: float = 1.0,
) -> dict[str, Any]:
    return {
        "loadBalancingConfig": [{"round_robin": {}}],
        "healthCheckConfig": {"serviceName": health_service},
        "methodConfig": [
            {
                "name": [{"service": service}],
                "waitForReady": True,
                "retryPolicy": {
                    "maxAttempts": max_attempts,
                    "initialBackoff": f"{initial_backoff_s}s",
                    "maxBackoff": f"{max_backoff_s}s",
                    "backoffMultiplier": 2,
                    "retryableStatusCodes": ["UNAVAILABLE"],
                },
            }
        ],
    }


def channel_options(**kw: Any) -> list[tuple[str, Any]]:
    return [
        ("grpc.service_config", json.dumps(service_config(**kw))),
        ("grpc.enable_retries", 1),
        ("grpc.dns_min_time_between_resolutions_ms", 1000),
    ]


def mesh_channel(
    target: str,
    credentials: grpc.ChannelCredentials | None = None,
    *,
    security: ChannelSecurity | None = None,
    **kw: Any,
) -> grpc.Channel:
    """A sync channel with the service config, e.g. ``mesh_channel("dns:///routers.svc:50051")``; TLS from
    `credentials` or `security`, and `security.token` (a role token or a router API key) as the bearer token
    of every call."""
    opts = channel_options(**kw)
    credentials = credentials or (security.credentials() if security else None)
    ch = grpc.secure_channel(target, credentials, opts) if credentials else grpc.insecure_channel(target, opts)
    return cast(grpc.Channel, TokenChannel(ch, security.token)) if security and security.token else ch


def mesh_aio_channel(
    target: str,
    credentials: grpc.ChannelCredentials | None = None,
    *,
    security: ChannelSecurity | None = None,
    **kw: Any,
) -> grpc.aio.Channel:
    """The aio twin of `mesh_channel`."""
    opts = channel_options(**kw)
    credentials = credentials or (security.credentials() if security else None)
    secure = grpc.aio.secure_channel
    ch = secure(target, credentials, opts) if credentials else grpc.aio.insecure_channel(target, opts)
    return cast(grpc.aio.Channel, TokenChannel(ch, security.token)) if security and security.token else ch
