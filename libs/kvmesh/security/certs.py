"""A development PKI (`kvmesh certs DIR`): a CA and one certificate per service / role identity.

Each leaf certificate carries the identity as its URI SAN ``spiffe://kvmesh/<zone>/<role>/<id>`` (what the
server skeleton reads the caller's role from), DNS ``localhost`` and IP ``127.0.0.1`` (plus any `hosts`),
and both extended key usages, so one pair serves a process's server and its outbound mTLS calls. Keys are
ECDSA P-256, files ``ca.pem`` (+ ``ca.key``), ``<role>-<id>.pem`` / ``.key``; keys are mode 0600. Valid for
`days` (default 30): a development CA, not a production one (see docs/security.md for cert-manager/SPIFFE).
"""

from __future__ import annotations

import datetime
import ipaddress
import os
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

from kvmesh.security.identity import Identity

DEFAULT_HOSTS = ("localhost", "127.0.0.1")


@dataclass(frozen=True)
class CertPair:
    """One identity's certificate and key files."""

    cert: Path
    key: Path


@dataclass(frozen=True)
class DevPki:
    """Where `make_dev_pki` wrote the CA and each identity's pair."""

    ca: Path
    pairs: dict[Identity, CertPair]


def _name(cn: str) -> x509.Name:
    return x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, cn)])


def _write_key(key: ec.EllipticCurvePrivateKey, path: Path) -> None:
    pem = key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption())
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "wb") as f:
        f.write(pem)
    os.chmod(path, 0o600)


def _key_usage(ca: bool) -> x509.KeyUsage:
    return x509.KeyUsage(
        digital_signature=True,
        key_cert_sign=ca,
        crl_sign=ca,
        content_commitment=False,
        key_encipherment=False,
        data_encipherment=False,
        key_agreement=False,
        encipher_only=False,
        decipher_only=False,
    )


def _builder(
    subject: x509.Name, issuer: x509.Name, key: ec.EllipticCurvePrivateKey, days: int
) -> x509.CertificateBuilder:
    now = datetime.datetime.now(datetime.UTC)
    return (
        x509.CertificateBuilder()
        .subject_name(subject)
        .issuer_name(issuer)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(minutes=5))
        .not_valid_after(now + datetime.timedelta(days=days))
    )


def _sans(ident: Identity, hosts: Sequence[str]) -> list[x509.GeneralName]:
    names: list[x509.GeneralName] = [x509.UniformResourceIdentifier(ident.spiffe_id)]
    for h in hosts:
        try:
            names.append(x509.IPAddress(ipaddress.ip_address(h)))
        except ValueError:
            names.append(x509.DNSName(h))
    return names


def make_dev_pki(
    directory: Path, identities: Sequence[Identity], hosts: Sequence[str] = DEFAULT_HOSTS, days: int = 30
) -> DevPki:
    """Writes a fresh CA and a pair per identity into `directory` (created mode 0700)."""
    directory.mkdir(parents=True, exist_ok=True)
    os.chmod(directory, 0o700)
    ca_key = ec.generate_private_key(ec.SECP256R1())
    ca_name = _name("kvmesh development CA")
    ca_cert = (
        _builder(ca_name, ca_name, ca_key, days)
        .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
        .add_extension(_key_usage(ca=True), critical=True)
        .sign(ca_key, hashes.SHA256())
    )
    ca_path = directory / "ca.pem"
    ca_path.write_bytes(ca_cert.public_bytes(serialization.Encoding.PEM))
    _write_key(ca_key, directory / "ca.key")
    pairs = {}
    for ident in identities:
        key = ec.generate_private_key(ec.SECP256R1())
        cert = (
            _builder(_name(str(ident)), ca_name, key, days)
            .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
            .add_extension(_key_usage(ca=False), critical=True)
            .add_extension(
                x509.ExtendedKeyUsage([ExtendedKeyUsageOID.SERVER_AUTH, ExtendedKeyUsageOID.CLIENT_AUTH]),
                critical=False,
            )
            .add_extension(x509.SubjectAlternativeName(_sans(ident, hosts)), critical=False)
            .sign(ca_key, hashes.SHA256())
        )
        stem = f"{ident.role.value}-{ident.id}"
        pair = CertPair(directory / f"{stem}.pem", directory / f"{stem}.key")
        pair.cert.write_bytes(cert.public_bytes(serialization.Encoding.PEM))
        _write_key(key, pair.key)
        pairs[ident] = pair
    return DevPki(ca_path, pairs)


def spiffe_ids_of_pem(pem: bytes) -> list[str]:
    """The kvmesh SPIFFE URI SANs of a PEM certificate ([] when it has none or does not parse)."""
    try:
        cert = x509.load_pem_x509_certificate(pem)
        sans = cert.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
    except (ValueError, x509.ExtensionNotFound):
        return []
    return [u for u in sans.get_values_for_type(x509.UniformResourceIdentifier) if u.startswith("spiffe://")]
