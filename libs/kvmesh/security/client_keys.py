"""Client API keys: who a key is, which tenants (cache salts) it may use, whether its requests are signed.

The keys file (``--api-keys-file``) is either the plain format, one key per line (``#`` comments), or YAML
(a file ending ``.yaml``/``.yml``, or whose first entry starts with ``- ``), a list of entries::

    - key: sk-alice-...            # required: the bearer key
      id: alice                    # the identity's id (default: key-<first 12 hex of SHA-256(key)>)
      tenants: [alice, shared]     # tenants it may declare, the first is its default (default: [id])
      signing_secret: ...          # HMAC-SHA256 secret for signed requests (kvmesh.security.signing)
      require_signature: true      # unsigned requests are refused (needs signing_secret)
      role: client                 # client (default) or admin
    - certificate: spiffe://kvmesh/-/client/bob   # instead of key: an mTLS client certificate's identity
      tenants: [bob, shared]

A certificate entry names a client (or admin) certificate by its URI SAN and gives it tenants (and an id, by
default the certificate's); it takes no signing fields, the TLS handshake already proves every call. A
client certificate named by no entry is its own tenant (its id), as a plain key is.

A plain key is ``{key, id: key-<sha256 prefix>, tenants: [that id]}``: every key its own tenant, so no key sees
another's cache; give keys a common tenant in YAML to share a cache on purpose. ``KVMESH_API_KEYS`` (comma-
separated plain keys) adds to the file. Lookup is by SHA-256 of the presented key, confirmed with
``hmac.compare_digest``; no keys at all disables authentication (an open router, tenants as declared).
"""

from __future__ import annotations

import hashlib
import hmac
import os
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

from kvmesh.core.errors import InvalidArgument, PermissionDenied, Unauthenticated
from kvmesh.security.identity import CallerRole, Identity, parse_spiffe_id
from kvmesh.security.signing import (
    DEFAULT_WINDOW_S,
    SIGNATURE_HEADER,
    TIMESTAMP_HEADER,
    ReplayGuard,
    SignedRequest,
    missing_headers,
    verify,
)

_FIELDS = frozenset({"key", "certificate", "id", "tenants", "signing_secret", "require_signature", "role"})
_ROLES = (CallerRole.CLIENT, CallerRole.ADMIN)


def _digest(key: str) -> bytes:
    return hashlib.sha256(key.encode()).digest()


def default_key_id(key: str) -> str:
    """``key-`` + the first 12 hex digits of SHA-256(key): an id that names a plain key without revealing it."""
    return "key-" + _digest(key).hex()[:12]


@dataclass(frozen=True)
class ClientKey:
    """One configured key; `tenants[0]` is the tenant of a request that declares none."""

    key: str
    id: str
    tenants: tuple[str, ...]
    signing_secret: str = ""
    require_signature: bool = False
    role: CallerRole = CallerRole.CLIENT
    certificate: str = ""  # set instead of `key`: the SPIFFE id of an mTLS client certificate

    @classmethod
    def plain(cls, key: str) -> ClientKey:
        kid = default_key_id(key)
        return cls(key, kid, (kid,))

    @property
    def identity(self) -> Identity:
        return Identity(self.role, self.id, tenants=self.tenants)

    def check_headers(self, req: SignedRequest) -> None:
        """Before the body is read: a key that requires signing refuses a request without both headers; a key
        without a secret refuses signing headers it cannot check. Unauthenticated naming what is missing."""
        if self.require_signature and (req.signature is None or req.timestamp is None):
            raise Unauthenticated(f"API key {self.id!r} requires a signed request: missing {missing_headers(req)}")
        if req.signed and not self.signing_secret:
            raise Unauthenticated(
                f"API key {self.id!r} has no signing secret: send no {SIGNATURE_HEADER}/{TIMESTAMP_HEADER}"
            )


def parse_entry(i: int, entry: Any) -> ClientKey:
    """One YAML entry; ValueError naming the entry (by index) and the field."""
    where = f"keys[{i}]"
    if not isinstance(entry, Mapping):
        raise ValueError(f"{where}: want a mapping with key, id, tenants, ..., got {type(entry).__name__}")
    unknown = sorted(set(map(str, entry)) - _FIELDS)
    if unknown:
        raise ValueError(f"{where}: unknown field(s) {', '.join(unknown)} (known: {', '.join(sorted(_FIELDS))})")
    if "certificate" in entry:
        return _certificate_entry(entry, where)
    key = _string(entry, "key", where, required=True)
    kid = _string(entry, "id", where) or default_key_id(key)
    tenants = _tenants(entry.get("tenants"), where) or (kid,)
    secret = _string(entry, "signing_secret", where)
    require = entry.get("require_signature", False)
    if not isinstance(require, bool):
        raise ValueError(f"{where}.require_signature: must be true or false")
    if require and not secret:
        raise ValueError(f"{where}.require_signature: needs signing_secret")
    role = _string(entry, "role", where) or CallerRole.CLIENT.value
    if role not in _ROLES:
        raise ValueError(f"{where}.role: must be one of {', '.join(_ROLES)}, got {role!r}")
    return ClientKey(key, kid, tenants, secret, require, CallerRole(role))


def _certificate_entry(entry: Mapping[str, Any], where: str) -> ClientKey:
    """A ``certificate:`` entry: the SPIFFE id of a client or admin certificate and its tenants."""
    for field in ("key", "signing_secret", "require_signature"):
        if field in entry:
            raise ValueError(f"{where}.{field}: not with certificate (mTLS authenticates every call)")
    spiffe = _string(entry, "certificate", where, required=True)
    try:
        peer = parse_spiffe_id(spiffe)
    except ValueError as e:
        raise ValueError(f"{where}.certificate: {e}") from None
    if peer.role not in _ROLES:
        raise ValueError(f"{where}.certificate: role {peer.role.value} is a service's, not a client's or admin's")
    role = _string(entry, "role", where) or peer.role.value
    if role != peer.role.value:
        raise ValueError(f"{where}.role: {role!r} differs from the certificate's role {peer.role.value!r}")
    kid = _string(entry, "id", where) or peer.id
    return ClientKey("", kid, _tenants(entry.get("tenants"), where) or (kid,), role=peer.role, certificate=spiffe)


def _string(entry: Mapping[str, Any], name: str, where: str, required: bool = False) -> str:
    v = entry.get(name)
    if v is None and not required:
        return ""
    if not isinstance(v, str) or (required and not v):
        raise ValueError(f"{where}.{name}: must be a {'non-empty ' if required else ''}string")
    return v


def _tenants(v: Any, where: str) -> tuple[str, ...]:
    if v is None:
        return ()
    items = [v] if isinstance(v, str) else v
    if not isinstance(items, list) or not all(isinstance(t, str) for t in items):
        raise ValueError(f"{where}.tenants: must be a string or a list of strings")
    return tuple(dict.fromkeys(items))


def parse_keys_text(text: str, yaml_format: bool) -> list[ClientKey]:
    """The entries of a keys file's text (plain: one key per line; YAML: see the module docstring)."""
    if not yaml_format:
        lines = (ln.strip() for ln in text.splitlines())
        return [ClientKey.plain(ln) for ln in lines if ln and not ln.startswith("#")]
    doc = yaml.safe_load(text)
    if isinstance(doc, Mapping) and set(doc) == {"keys"}:
        doc = doc["keys"]
    if doc is None:
        return []
    if not isinstance(doc, list):
        raise ValueError("keys file: want a YAML list of entries (or {keys: [...]})")
    return [parse_entry(i, e) for i, e in enumerate(doc)]


def is_yaml_keys_file(path: str, text: str) -> bool:
    """YAML when the name ends .yaml/.yml or the first entry starts with ``- `` (a plain key has no space)."""
    if path.endswith((".yaml", ".yml")):
        return True
    first = next((ln.strip() for ln in text.splitlines() if ln.strip() and not ln.strip().startswith("#")), "")
    return first.startswith("- ") or first == "keys:"


class ClientKeys:
    """The configured keys, the signature window and the replay memory; no keys disables authentication."""

    def __init__(
        self, keys: Iterable[ClientKey], window_s: float = DEFAULT_WINDOW_S, replay_capacity: int = 100_000
    ) -> None:
        self._by_digest: dict[bytes, ClientKey] = {}
        self._by_certificate: dict[str, ClientKey] = {}
        ids: set[str] = set()
        for k in keys:
            if k.certificate:
                if k.certificate in self._by_certificate or k.id in ids:
                    raise ValueError(f"certificate {k.certificate!r}: a certificate and an id may be configured once")
                self._by_certificate[k.certificate] = k
            else:
                d = _digest(k.key)
                if d in self._by_digest or k.id in ids:
                    raise ValueError(f"API key {k.id!r}: a key and an id may be configured once")
                self._by_digest[d] = k
            ids.add(k.id)
        self.window_s = window_s
        self.replay = ReplayGuard(window_s, replay_capacity)

    @classmethod
    def load(
        cls,
        path: str = "",
        env_var: str = "KVMESH_API_KEYS",
        window_s: float = DEFAULT_WINDOW_S,
        replay_capacity: int = 100_000,
    ) -> ClientKeys:
        """Keys from a file (plain or YAML, see the module docstring) and a comma-separated environment variable;
        InvalidArgument("api_keys_file") naming the file, the entry and the field when the file is wrong."""
        keys = [ClientKey.plain(k.strip()) for k in os.environ.get(env_var, "").split(",") if k.strip()]
        try:
            if path:
                text = Path(path).read_text()
                keys = parse_keys_text(text, is_yaml_keys_file(path, text)) + keys
            return cls(keys, window_s, replay_capacity)
        except (ValueError, yaml.YAMLError) as e:
            raise InvalidArgument("api_keys_file", f"{path or env_var}: {e}") from None

    @property
    def enabled(self) -> bool:
        return bool(self._by_digest)

    def lookup(self, presented: str | None) -> ClientKey | None:
        """The key presented (None: authentication disabled); Unauthenticated when missing or unknown."""
        if not self._by_digest:
            return None
        if not presented:
            raise Unauthenticated("missing API key")
        d = _digest(presented)
        k = self._by_digest.get(d)
        if k is None or not hmac.compare_digest(_digest(k.key), d):
            raise Unauthenticated("unknown API key")
        return k

    def verify(
        self, key: ClientKey | None, req: SignedRequest, now: float, charge: Callable[[str], None] = lambda _: None
    ) -> Identity | None:
        """The caller's identity once `req` passes `key`'s signing rules (signature, window, replay); `now`:
        unix seconds. `charge(id)` (the rate limit; id ``anonymous`` without keys) runs once the request is
        authentic, before its signature is remembered (`ReplayGuard.admit`). None for an open router."""
        if key is None:
            charge("anonymous")
            return None
        key.check_headers(req)
        if req.signed:
            sig, ts = verify(key.signing_secret, req, now, self.window_s)
            self.replay.admit(sig, ts, now, lambda: charge(key.id))
        else:
            charge(key.id)
        return key.identity

    def for_certificate(self, peer: Identity) -> Identity:
        """The identity an mTLS client (or admin) certificate, or role token, acts as: its certificate entry's
        id and tenants; else the tenants it came with (a token's); else its id as its one tenant (so no
        certificate sees another's cache)."""
        k = self._by_certificate.get(peer.spiffe_id)
        if k is not None:
            return Identity(peer.role, k.id, peer.zone, k.tenants)
        return Identity(peer.role, peer.id, peer.zone, peer.tenants or (peer.id,))

    def authenticate(self, presented: str | None, req: SignedRequest, now: float) -> Identity | None:
        """`lookup` then `verify`, for a request whose body is already in hand."""
        return self.verify(self.lookup(presented), req, now)


def bind_tenant(identity: Identity | None, declared: str) -> str:
    """The tenant a request runs as: the declared one when the identity may use it, the identity's first
    tenant when none is declared, PermissionDenied naming the tenant otherwise; without an identity (no keys
    configured) the declared one, as before keys."""
    if identity is None:
        return declared
    if not declared:
        return identity.tenants[0] if identity.tenants else ""
    if declared not in identity.tenants:
        raise PermissionDenied(
            f"tenant {declared!r} is not allowed for {identity.role.value} {identity.id!r} "
            f"(allowed: {', '.join(identity.tenants)})"
        )
    return declared
