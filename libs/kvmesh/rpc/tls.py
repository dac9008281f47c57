"""TLS / mTLS credentials from PEM files, for servers and for outbound channels."""

from __future__ import annotations

from pathlib import Path

import grpc

from kvmesh.errors import FailedPrecondition


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
