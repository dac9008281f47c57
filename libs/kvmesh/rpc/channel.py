"""Outbound gRPC channels: TLS when configured, request id / trace context / deadline propagation."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import grpc

from kvmesh.config import ServerSettings
from kvmesh.rpc.tls import channel_credentials
from kvmesh.telemetry import tracing
from kvmesh.telemetry.context import REQUEST_ID_HEADER, outbound_timeout, request_id_var

CHANNEL_OPTIONS = [
    ("grpc.max_send_message_length", 64 * 1024 * 1024),
    ("grpc.max_receive_message_length", 64 * 1024 * 1024),
    ("grpc.keepalive_time_ms", 10_000),
    ("grpc.keepalive_timeout_ms", 5_000),
    ("grpc.keepalive_permit_without_calls", 1),
    ("grpc.http2.max_pings_without_data", 0),
    ("grpc.enable_retries", 0),
]


class _PropagatingInterceptor(
    grpc.aio.UnaryUnaryClientInterceptor,
    grpc.aio.UnaryStreamClientInterceptor,
    grpc.aio.StreamUnaryClientInterceptor,
    grpc.aio.StreamStreamClientInterceptor,
):
    """Adds `x-request-id` and `traceparent`, and caps the timeout at the current request's remaining time."""

    def _details(self, details: grpc.aio.ClientCallDetails) -> grpc.aio.ClientCallDetails:
        metadata = grpc.aio.Metadata(*(details.metadata or ()))
        request_id = request_id_var.get()
        if request_id and REQUEST_ID_HEADER not in metadata:
            metadata.add(REQUEST_ID_HEADER, request_id)
        carrier: dict[str, str] = {}
        tracing.inject(carrier)
        for key, value in carrier.items():
            metadata.add(key, value)
        return grpc.aio.ClientCallDetails(
            method=details.method,
            timeout=outbound_timeout(details.timeout),
            metadata=metadata,
            credentials=details.credentials,
            wait_for_ready=details.wait_for_ready,
        )

    async def intercept_unary_unary(self, continuation: Callable[..., Any], details: Any, request: Any) -> Any:
        return await continuation(self._details(details), request)

    async def intercept_unary_stream(self, continuation: Callable[..., Any], details: Any, request: Any) -> Any:
        return await continuation(self._details(details), request)

    async def intercept_stream_unary(self, continuation: Callable[..., Any], details: Any, it: Any) -> Any:
        return await continuation(self._details(details), it)

    async def intercept_stream_stream(self, continuation: Callable[..., Any], details: Any, it: Any) -> Any:
        return await continuation(self._details(details), it)


def open_channel(address: str, settings: ServerSettings | None = None) -> grpc.aio.Channel:
    """An aio channel to `address`, secure when `settings.tls_ca` is set."""
    interceptors = [_PropagatingInterceptor()]
    if settings is not None and settings.tls_ca:
        creds = channel_credentials(settings.tls_ca, settings.tls_client_cert, settings.tls_client_key)
        return grpc.aio.secure_channel(address, creds, options=CHANNEL_OPTIONS, interceptors=interceptors)
    return grpc.aio.insecure_channel(address, options=CHANNEL_OPTIONS, interceptors=interceptors)
