"""Bearer tokens that stand for identities: the file a server accepts, a process's own token, provisioning.

The accepted-tokens file (setting `auth_tokens_file`) is YAML:

    tokens:
      - sha256: 9f86d081884c7d65...      # hex SHA-256 of the token (or `token: <the token itself>`)
        identity: spiffe://kvmesh/local/worker/worker-local-0
      - sha256: 2c26b46b68ffc68f...
        identity: spiffe://kvmesh/local/client/alice
        tenants: [alice, alice-eval]      # clients: the tenants (cache salts) it may use, first = default

A server keeps only the digests: a presented token is hashed and looked up by its digest, so neither the
file nor the lookup's timing reveals a token. A process's own token (setting `auth_token_file`) is a file
holding the token alone; it is sent as ``authorization: Bearer <token>`` on every outbound call.
"""

from __future__ import annotations

import hashlib
import os
import secrets
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

from kvmesh.core.errors import FailedPrecondition
from kvmesh.security.identity import Identity, parse_spiffe_id

BEARER = "bearer "


def digest(token: str) -> str:
    """hex SHA-256 of the token's UTF-8 bytes."""
    return hashlib.sha256(token.encode()).hexdigest()


def bearer_of(value: str | None) -> str | None:
    """The token of an ``authorization: Bearer <token>`` value (None for any other scheme or none)."""
    if value and value[: len(BEARER)].lower() == BEARER:
        return value[len(BEARER) :].strip() or None
    return None


@dataclass(frozen=True)
class TokenTable:
    """The identities of the accepted tokens, by digest."""

    by_digest: Mapping[str, Identity]

    def identity(self, token: str | None) -> Identity | None:
        return self.by_digest.get(digest(token)) if token else None

    @classmethod
    def load(cls, path: str) -> TokenTable:
        """Parses the accepted-tokens file; FailedPrecondition naming the file and entry on bad content."""
        try:
            doc = yaml.safe_load(Path(path).read_text())
        except OSError as exc:
            raise FailedPrecondition(f"cannot read auth_tokens_file {path!r}: {exc.strerror}") from exc
        except yaml.YAMLError as exc:
            raise FailedPrecondition(f"auth_tokens_file {path!r} is not YAML: {exc}") from exc
        entries = doc.get("tokens") if isinstance(doc, dict) else None
        if not isinstance(entries, list):
            raise FailedPrecondition(f"auth_tokens_file {path!r}: want a mapping with a `tokens` list")
        table = {}
        for i, entry in enumerate(entries):
            try:
                key, ident = _entry(entry)
            except ValueError as exc:
                raise FailedPrecondition(f"auth_tokens_file {path!r}: tokens[{i}]: {exc}") from None
            table[key] = ident
        return cls(table)


def _entry(entry: Any) -> tuple[str, Identity]:
    if not isinstance(entry, dict):
        raise ValueError("want a mapping with sha256 (or token) and identity")
    if "sha256" in entry:
        key = str(entry["sha256"]).lower()
        if len(key) != 64 or any(c not in "0123456789abcdef" for c in key):
            raise ValueError("sha256: want 64 hex digits")
    elif entry.get("token"):
        key = digest(str(entry["token"]))
    else:
        raise ValueError("want sha256 or token")
    ident = parse_spiffe_id(str(entry.get("identity", "")))
    tenants = entry.get("tenants") or []
    if not isinstance(tenants, list) or not all(isinstance(t, str) and t for t in tenants):
        raise ValueError("tenants: want a list of non-empty strings")
    return key, Identity(ident.role, ident.id, ident.zone, tuple(tenants))


def read_own_token(path: str) -> str:
    """This process's token from `auth_token_file` (its first line); FailedPrecondition if unreadable/empty."""
    try:
        text = Path(path).read_text().strip()
    except OSError as exc:
        raise FailedPrecondition(f"cannot read auth_token_file {path!r}: {exc.strerror}") from exc
    if not text:
        raise FailedPrecondition(f"auth_token_file {path!r} is empty")
    return text.splitlines()[0].strip()


def _write_private(path: Path, text: str) -> None:
    """Writes `text` to a file only its owner may read (0600 from creation, never world-readable)."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as f:
        f.write(text)
    os.chmod(path, 0o600)


def provision(directory: Path, identities: Sequence[Identity]) -> dict[Identity, Path]:
    """A fresh random token per identity in `directory` (mode 0700): ``<role>-<id>.token`` files (0600)
    and the accepted-tokens file ``tokens.yaml`` (0600, digests only). Returns each identity's token file."""
    directory.mkdir(parents=True, exist_ok=True)
    os.chmod(directory, 0o700)
    own: dict[Identity, Path] = {}
    entries = []
    for ident in identities:
        token = secrets.token_urlsafe(32)
        path = directory / f"{ident.role.value}-{ident.id}.token"
        _write_private(path, token + "\n")
        own[ident] = path
        entry: dict[str, Any] = {"sha256": digest(token), "identity": ident.spiffe_id}
        if ident.tenants:
            entry["tenants"] = list(ident.tenants)
        entries.append(entry)
    _write_private(accepted_file(directory), yaml.safe_dump({"tokens": entries}, sort_keys=False))
    return own


def accepted_file(directory: Path) -> Path:
    """The accepted-tokens file `provision` writes in `directory`."""
    return directory / "tokens.yaml"
