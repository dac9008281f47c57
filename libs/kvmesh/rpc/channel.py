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
from typing import Any, Protocol, cast

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

# The client library's channels to routers and failover services: a ping every 2 s, answered within 1 s, so a
# stream on a zone whose link died silently (no reset ever comes) fails in about 3 s and the request resumes
# elsewhere; servers accept pings this often (`kvmesh.rpc.server`, min_ping_interval_without_data_ms).
# grpc-core (1.85 here) waits for a ping's ack `grpc.http2.ping_timeout_ms` (default 60 s), not keepalive_timeout:
# without it a silent link (a stopped proxy, a dead host) held a stream open for a minute.
LIVENESS_OPTIONS = [
    ("grpc.keepalive_time_ms", 2_000),
    ("grpc.keepalive_timeout_ms", 1_000),
    ("grpc.http2.ping_timeout_ms", 1_000),
    ("grpc.keepalive_permit_without_calls", 1),
    ("grpc.http2.max_pings_without_data", 0),
]

# A cache-manager's channels to the zones it follows and replicates into: CHANNEL_OPTIONS with the liveness
# pings (a zone lost with its link must show as not followed live within seconds, not after a 15 s keepalive).
ZONE_LINK_OPTIONS = list({**dict(CHANNEL_OPTIONS), **dict(LIVENESS_OPTIONS)}.items())


class _PropagatingInterceptor(grpc.aio.UnaryUnaryClientInterceptor):
    """Adds `x-request-id` and `traceparent`, and caps the timeout at the current request's remaining time.

    Unary-unary calls only: grpc.aio files an interceptor under the first of the four kinds it implements, so
    streams never went through it (and a long-lived stream opened while one request is handled must not
    inherit that request's deadline or id)."""

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


class _WithToken:
    """A multi-callable whose calls carry ``authorization: Bearer <token>`` (unless the caller set its own).
    Added to the call's metadata, not by a client interceptor: grpc.aio wraps an intercepted streaming call's
    response iterator in Python (more work per received message, on the router's streams from workers);
    this costs nothing per message."""

    __slots__ = ("_authorization", "_inner")

    def __init__(self, inner: Any, authorization: str) -> None:
        self._inner, self._authorization = inner, authorization

    def __call__(self, *args: Any, metadata: Any = None, **kwargs: Any) -> Any:
        items = tuple(metadata or ())
        if not any(k == "authorization" for k, _ in items):
            items += (("authorization", self._authorization),)
        return self._inner(*args, metadata=items, **kwargs)


class TokenChannel:
    """A `grpc.aio.Channel` (or a sync `grpc.Channel`) whose every call carries a bearer token (see
    `_WithToken`)."""

    def __init__(self, channel: grpc.aio.Channel, token: str) -> None:
        self._channel = channel
        self._authorization = f"Bearer {token}"

    def unary_unary(self, *args: Any, **kwargs: Any) -> Any:
        return _WithToken(self._channel.unary_unary(*args, **kwargs), self._authorization)

    def unary_stream(self, *args: Any, **kwargs: Any) -> Any:
        return _WithToken(self._channel.unary_stream(*args, **kwargs), self._authorization)

    def stream_unary(self, *args: Any, **kwargs: Any) -> Any:
        return _WithToken(self._channel.stream_unary(*args, **kwargs), self._authorization)

    def stream_stream(self, *args: Any, **kwargs: Any) -> Any:
        return _WithToken(self._channel.stream_stream(*args, **kwargs), self._authorization)

    def __getattr__(self, name: str) -> Any:  # close, channel_ready, get_state, ...
        return getattr(self._channel, name)

    async def __aenter__(self) -> TokenChannel:
        return self

    def __enter__(self) -> TokenChannel:
        return self

    def __exit__(self, *exc: object) -> None:
        self._channel.close()

    async def __aexit__(self, *exc: object) -> None:
        await self._channel.close()


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
    interceptors = [_PropagatingInterceptor()] if propagate else None
    creds = sec.credentials()
    if creds is not None:
        channel = grpc.aio.secure_channel(address, creds, options=list(options), interceptors=interceptors)
    else:
        channel = grpc.aio.insecure_channel(address, options=list(options), interceptors=interceptors)
    return cast(grpc.aio.Channel, TokenChannel(channel, sec.token)) if sec.token else channel
