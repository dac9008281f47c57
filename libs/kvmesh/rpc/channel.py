"""Outbound gRPC channels: TLS when configured, request id / trace context / deadline propagation.

Every channel a kvmesh process opens goes through `open_channel(address, security)`, where `security` is a
`ChannelSecurity` (CA, client certificate and key) or any settings carrying the `tls_ca`/`tls_client_cert`/
`tls_client_key` fields of `ServerSettings`; without a CA the channel is plaintext.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

import grpc

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


class _TlsClientSettings(Protocol):
    @property
    def tls_ca(self) -> str: ...
    @property
    def tls_client_cert(self) -> str: ...
    @property
    def tls_client_key(self) -> str: ...


@dataclass(frozen=True)
class ChannelSecurity:
    """TLS of outbound channels: verify servers against `tls_ca`; present the client pair when given (mTLS)."""

    tls_ca: str = ""
    tls_client_cert: str = ""
    tls_client_key: str = ""

    @staticmethod
    def of(settings: _TlsClientSettings | None) -> ChannelSecurity:
        """The outbound TLS part of `settings` (e.g. a `ServerSettings`); plaintext for None."""
        if settings is None:
            return PLAINTEXT
        return ChannelSecurity(settings.tls_ca, settings.tls_client_cert, settings.tls_client_key)

    def credentials(self) -> grpc.ChannelCredentials | None:
        """Channel credentials, or None for plaintext."""
        if not self.tls_ca:
            return None
        return channel_credentials(self.tls_ca, self.tls_client_cert, self.tls_client_key)


PLAINTEXT = ChannelSecurity()


def open_channel(
    address: str,
    security: _TlsClientSettings | None = None,
    *,
    options: Sequence[tuple[str, Any]] = CHANNEL_OPTIONS,
    propagate: bool = True,
) -> grpc.aio.Channel:
    """An aio channel to `address`, secure when `security.tls_ca` is set. `propagate=False` leaves out the
    request-id / trace / deadline interceptor (hot paths whose callers pass the metadata themselves)."""
    interceptors = [_PropagatingInterceptor()] if propagate else None
    creds = ChannelSecurity.of(security).credentials()
    if creds is not None:
        return grpc.aio.secure_channel(address, creds, options=list(options), interceptors=interceptors)
    return grpc.aio.insecure_channel(address, options=list(options), interceptors=interceptors)
