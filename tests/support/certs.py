"""Test PKI on the development CA of `kvmesh certs` (kvmesh.security.certs): a server pair, a client pair and
an unrelated CA (PEM files)."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from kvmesh.security.certs import make_dev_pki
from kvmesh.security.identity import CallerRole, Identity


@dataclass(frozen=True)
class TestPki:
    ca: Path
    server_cert: Path
    server_key: Path
    client_cert: Path
    client_key: Path
    other_ca: Path  # a CA that signed nothing here: trusting only it must fail


def make_pki(directory: Path) -> TestPki:
    """Writes a fresh PKI into `directory`: the server is a router identity, the client a client one."""
    server, client = Identity(CallerRole.ROUTER, "test-server"), Identity(CallerRole.CLIENT, "test-client")
    pki = make_dev_pki(directory, [server, client])
    other = make_dev_pki(directory / "other", [])
    return TestPki(
        pki.ca,
        pki.pairs[server].cert,
        pki.pairs[server].key,
        pki.pairs[client].cert,
        pki.pairs[client].key,
        other.ca,
    )
