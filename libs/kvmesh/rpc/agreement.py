"""Settings that must agree across services, and the check a service runs when it meets a peer.

A router, its cache-manager and its workers must use the same block size, and the router's hash salt model
must equal the cache-manager's: otherwise block hashes never match and routing silently loses every prefix
hit. `disagreements(peer, pairs)` compares this service's values with what the peer reports (`GetInfo`,
`GetStats`) and returns one message per mismatch, naming both values and the flag to fix; a peer value that
is unknown (`0` / empty from an older peer, see `unknown`) is not compared.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from kvmesh.core.errors import FailedPrecondition


@dataclass(frozen=True)
class Agreed:
    """One setting to compare: its flag, this service's value, the peer's value, and whether the peer's value
    is unknown (an older peer that does not report it)."""

    flag: str
    mine: object
    theirs: object
    unknown: bool = False


def disagreements(peer: str, pairs: Sequence[Agreed]) -> list[str]:
    """One message per setting where `peer` differs from this service."""
    return [
        f"{peer} has {p.flag} {p.theirs!r} but this service has {p.flag} {p.mine!r}: {p.flag} must agree"
        for p in pairs
        if not p.unknown and p.mine != p.theirs
    ]


def require_agreement(peer: str, pairs: Sequence[Agreed]) -> None:
    """Raises FailedPrecondition listing every disagreement with `peer`."""
    problems = disagreements(peer, pairs)
    if problems:
        raise FailedPrecondition("; ".join(problems))
