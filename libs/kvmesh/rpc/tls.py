"""TLS / mTLS credentials from PEM files, for servers and for outbound channels."""

from __future__ import annotations

import ssl
from pathlib import Path

import grpc

from kvmesh.core.errors import FailedPrecondition


def _read(path: str, what: str) -> bytes:
    try:
        return Path(path).read_bytes()
    except OSError as exc:
        raise FailedPrecondition(f"cannot read {what} {path!r}: {exc.strerror}") from exc


def server_credentials(cert: str, key: str, client_ca: str = "") -> grpc.ServerCredentials:
    """TLS with `cert`/`key`; with `client_ca`, clients must present a certificate signed by it (mTLS)."""
    pair = [(_read(key, "TLS key"), _read(cert, "TLS certificate"))]
    if client_ca:
        return grpc.ssl_server_credentials(
            pair, root_certificates=_read(client_ca, "client CA"), require_client_auth=True
        )
    return grpc.ssl_server_credentials(pair)


def channel_credentials(ca: str, cert: str = "", key: str = "") -> grpc.ChannelCredentials:
    """Verifies servers against `ca`; presents `cert`/`key` when given (mTLS)."""
    return grpc.ssl_channel_credentials(
        root_certificates=_read(ca, "CA"),
        private_key=_read(key, "client key") if key else None,
        certificate_chain=_read(cert, "client certificate") if cert else None,
    )


def server_ssl_context(cert: str, key: str, client_ca: str = "", client_cert_required: bool = True) -> ssl.SSLContext:
    """`server_credentials` for a plain TLS listener (the worker's generate frames, the HTTP servers): the same
    files, so the same identities; with `client_ca` a client must present a certificate signed by it, or, with
    `client_cert_required=False` (HTTPS, where an OpenAI client has an API key but no certificate), may: one it
    presents is still verified against `client_ca`."""
    ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    try:
        ctx.load_cert_chain(cert, key)
        if client_ca:
            ctx.load_verify_locations(client_ca)
            ctx.verify_mode = ssl.CERT_REQUIRED if client_cert_required else ssl.CERT_OPTIONAL
    except (OSError, ssl.SSLError) as exc:
        raise FailedPrecondition(f"cannot load TLS files {cert!r}, {key!r}, {client_ca!r}: {exc}") from exc
    return ctx


def client_ssl_context(ca: str, cert: str = "", key: str = "") -> ssl.SSLContext:
    """`channel_credentials` for a plain TLS connection: verifies the server against `ca` (and its host name,
    as gRPC does); presents `cert`/`key` when given (mTLS)."""
    ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)  # verifies the chain and host name; no system CAs
    try:
        ctx.load_verify_locations(ca)
        if cert:
            ctx.load_cert_chain(cert, key)
    except (OSError, ssl.SSLError) as exc:
        raise FailedPrecondition(f"cannot load TLS files {ca!r}, {cert!r}, {key!r}: {exc}") from exc
    return ctx
