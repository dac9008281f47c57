"""Caller identities: a role, an id, a zone, and for clients the tenants (cache salts) they may use.

An identity comes from the caller's mTLS certificate (URI SAN ``spiffe://kvmesh/<zone>/<role>/<id>``) or,
without TLS, from a bearer token (``authorization: Bearer <token>`` in gRPC metadata or HTTP headers) that
maps to one identity. The server skeleton resolves it once per call and sets :data:`identity_var` for the
handler; handlers read it with :func:`current_identity`.
"""

from __future__ import annotations

import enum
from contextvars import ContextVar
from dataclasses import dataclass

SPIFFE_PREFIX = "spiffe://kvmesh/"


class CallerRole(enum.StrEnum):
    """What a caller is; the authorisation table (``kvmesh.security.authz``) grants RPCs and routes by it."""

    CLIENT = "client"
    ADMIN = "admin"
    ROUTER = "router"
    WORKER = "worker"
    CACHE_MANAGER = "cache-manager"
    FAILOVER = "failover"
    PEER_ZONE = "peer-zone"
    PLANNER = "planner"  # the autoscaler: reads the router's workers and drains the ones it removes


@dataclass(frozen=True)
class Identity:
    """An authenticated caller. ``tenants``: the cache salts a client may use (first = its default); empty
    for service roles, which act for no tenant."""

    role: CallerRole
    id: str
    zone: str = ""
    tenants: tuple[str, ...] = ()

    @property
    def spiffe_id(self) -> str:
        """``spiffe://kvmesh/<zone>/<role>/<id>`` (zone ``-`` when unset)."""
        return f"{SPIFFE_PREFIX}{self.zone or '-'}/{self.role.value}/{self.id}"

    def __str__(self) -> str:
        return f"{self.role.value}:{self.id}"


def parse_spiffe_id(uri: str) -> Identity:
    """The identity a certificate's URI SAN names; ValueError naming what is wrong."""
    if not uri.startswith(SPIFFE_PREFIX):
        raise ValueError(f"not a kvmesh SPIFFE id (want {SPIFFE_PREFIX}<zone>/<role>/<id>): {uri!r}")
    parts = uri[len(SPIFFE_PREFIX) :].split("/")
    if len(parts) != 3 or not all(parts):
        raise ValueError(f"want {SPIFFE_PREFIX}<zone>/<role>/<id>, got {uri!r}")
    zone, role, ident = parts
    try:
        caller_role = CallerRole(role)
    except ValueError:
        known = ", ".join(r.value for r in CallerRole)
        raise ValueError(f"unknown role {role!r} in {uri!r} (known: {known})") from None
    return Identity(caller_role, ident, "" if zone == "-" else zone)


identity_var: ContextVar[Identity | None] = ContextVar("kvmesh_identity", default=None)


def current_identity() -> Identity | None:
    """The identity of the call being handled (None: anonymous, or a service running without auth)."""
    return identity_var.get()
