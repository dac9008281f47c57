"""Outbound gRPC channels: TLS when configured, this process's bearer token, request id / trace context /
deadline propagation.

Every channel a kvmesh process opens goes through `open_channel(address, security)`, where `security` is a
`ChannelSecurity` (CA, client certificate and key, bearer token) or any settings carrying the `tls_ca`/
`tls_client_cert`/`tls_client_key` (and `auth_token_file`) fields of `ServerSettings`; without a CA the
channel is plaintext. With a token every call carries ``authorization: Bearer <token>`` (unless the caller
set its own `authorization`), the identity the callee's authorisation table admits (`kvmesh.security`).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

import grpc

from kvmesh.rpc.tls import channel_credentials
from kvmesh.security.tokens import read_own_token
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


class _PropagatingInterceptor(grpc.aio.UnaryUnaryClientInterceptor):
    """Adds `x-request-id`, `traceparent` and the bearer token, and caps the timeout at the current request's
    remaining time; `propagate=False`: the bearer token only.

    Unary-unary calls only: grpc.aio files an interceptor under the first of the four kinds it implements, so
    streams never went through this one; they get `_TokenInterceptor` (a long-lived stream opened while one
    request is handled must not inherit that request's deadline or id)."""

    def __init__(self, token: str = "", propagate: bool = True) -> None:
        self._authorization = f"Bearer {token}" if token else ""
        self._propagate = propagate

    def _details(self, details: grpc.aio.ClientCallDetails) -> grpc.aio.ClientCallDetails:
        metadata = _with_token(details, self._authorization)
        if not self._propagate:
            return grpc.aio.ClientCallDetails(
                details.method, details.timeout, metadata, details.credentials, details.wait_for_ready
            )
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


def _with_token(details: grpc.aio.ClientCallDetails, authorization: str) -> grpc.aio.Metadata:
    """The call's metadata plus `authorization` (unless empty, or the caller set its own)."""
    metadata = grpc.aio.Metadata(*(details.metadata or ()))
    if authorization and "authorization" not in metadata:
        metadata.add("authorization", authorization)
    return metadata


class _TokenCall:
    """The bearer token on calls of one stream kind (see `_PropagatingInterceptor`)."""

    def __init__(self, token: str) -> None:
        self._authorization = f"Bearer {token}"

    def _details(self, d: grpc.aio.ClientCallDetails) -> grpc.aio.ClientCallDetails:
        return grpc.aio.ClientCallDetails(
            d.method, d.timeout, _with_token(d, self._authorization), d.credentials, d.wait_for_ready
        )


class _TokenUnaryStream(_TokenCall, grpc.aio.UnaryStreamClientInterceptor):
    async def intercept_unary_stream(self, continuation: Callable[..., Any], details: Any, request: Any) -> Any:
        return await continuation(self._details(details), request)


class _TokenStreamUnary(_TokenCall, grpc.aio.StreamUnaryClientInterceptor):
    async def intercept_stream_unary(self, continuation: Callable[..., Any], details: Any, it: Any) -> Any:
        return await continuation(self._details(details), it)


class _TokenStreamStream(_TokenCall, grpc.aio.StreamStreamClientInterceptor):
    async def intercept_stream_stream(self, continuation: Callable[..., Any], details: Any, it: Any) -> Any:
        return await continuation(self._details(details), it)


def _interceptors(token: str, propagate: bool) -> list[Any] | None:
    """The channel's client interceptors: propagation on unary calls, the token on every kind."""
    out: list[Any] = [_PropagatingInterceptor(token, propagate)] if propagate or token else []
    if token:
        out += [_TokenUnaryStream(token), _TokenStreamUnary(token), _TokenStreamStream(token)]
    return out or None


class _TlsClientSettings(Protocol):
    @property
    def tls_ca(self) -> str: ...
    @property
    def tls_client_cert(self) -> str: ...
    @property
    def tls_client_key(self) -> str: ...


@dataclass(frozen=True)
class ChannelSecurity:
    """Security of outbound channels: verify servers against `tls_ca`; present the client pair when given
    (mTLS); send `token` as the bearer token of every call when given."""

    tls_ca: str = ""
    tls_client_cert: str = ""
    tls_client_key: str = ""
    token: str = ""

    @staticmethod
    def of(settings: _TlsClientSettings | None) -> ChannelSecurity:
        """The outbound part of `settings` (e.g. a `ServerSettings`: its token read from `auth_token_file`);
        plaintext for None."""
        if settings is None:
            return PLAINTEXT
        if isinstance(settings, ChannelSecurity):
            return settings
        token_file = getattr(settings, "auth_token_file", "")
        token = read_own_token(token_file) if token_file else ""
        return ChannelSecurity(settings.tls_ca, settings.tls_client_cert, settings.tls_client_key, token)

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
    """An aio channel to `address`, secure when `security.tls_ca` is set, its calls carrying the bearer token
    when there is one. `propagate=False` leaves out request-id / trace / deadline propagation (hot paths
    whose callers pass the metadata themselves; without a token, no interceptor at all)."""
    sec = ChannelSecurity.of(security)
    interceptors = _interceptors(sec.token, propagate)
    creds = sec.credentials()
    if creds is not None:
        return grpc.aio.secure_channel(address, creds, options=list(options), interceptors=interceptors)
    return grpc.aio.insecure_channel(address, options=list(options), interceptors=interceptors)
