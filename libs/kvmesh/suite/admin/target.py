"""Where the admin CLI connects, and as whom.

Addresses, per service: ``--router`` / ``--failover`` / ``--cache-manager`` / ``--planner``, else
``KVMESH_ROUTER`` / ``KVMESH_FAILOVER`` / ``KVMESH_CACHE_MANAGER`` / ``KVMESH_PLANNER``, else the local suite's state
file (``run/suite.json`` that `kvmesh up` writes under ``$KVMESH_HOME``): the service of zone ``--zone NAME``
(``KVMESH_ZONE``), or of the suite's first zone.

Credentials: ``--token`` / ``--token-file`` (a role token, ``KVMESH_TOKEN`` / ``KVMESH_TOKEN_FILE``) or
``--api-key`` (a router API key of role admin, ``KVMESH_API_KEY``), sent as the bearer token; TLS with ``--ca``
(``KVMESH_CA``) and, for mTLS, ``--cert``/``--key`` (``KVMESH_CERT``/``KVMESH_KEY``). A service found in the
local suite's state gets the suite's operator credential (its admin token, and its admin certificate when the
suite runs TLS) where the flags give none, and so does an address given by hand that is one of the running
suite's own (its zone-b router, say); a suite credential is never sent to any other address.
"""

from __future__ import annotations

import argparse
import json
import os
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from kvmesh.rpc.channel import ChannelSecurity
from kvmesh.security.tokens import read_own_token
from kvmesh.suite.local import state_path

SERVICES = ("router", "failover", "cache-manager", "planner")
_ENV = {s: "KVMESH_" + s.upper().replace("-", "_") for s in SERVICES}


class AdminError(Exception):
    """A failure the CLI reports in one line on stderr, exiting with `exit_code`."""

    def __init__(self, message: str, exit_code: int = 1) -> None:
        super().__init__(message)
        self.exit_code = exit_code


EXIT_FAILED, EXIT_USAGE, EXIT_DENIED, EXIT_UNREACHABLE = 1, 2, 3, 4


@dataclass(frozen=True)
class Target:
    """One service to call: its address, the security of the channel, and where the address came from."""

    service: str
    address: str
    security: ChannelSecurity
    source: str  # "flag", "env" or the suite state file's path


def add_arguments(p: argparse.ArgumentParser) -> None:
    """The connection flags every admin command takes."""
    g = p.add_argument_group("target (default: the local suite of `kvmesh up`)")
    g.add_argument("--router", metavar="HOST:PORT", help="router gRPC address (env KVMESH_ROUTER)")
    g.add_argument("--failover", metavar="HOST:PORT", help="failover gRPC address (env KVMESH_FAILOVER)")
    g.add_argument("--cache-manager", metavar="HOST:PORT", help="cache-manager gRPC address (env KVMESH_CACHE_MANAGER)")
    g.add_argument("--planner", metavar="HOST:PORT", help="planner gRPC address (env KVMESH_PLANNER)")
    g.add_argument(
        "--zone", metavar="NAME", help="the local suite's zone to act on (env KVMESH_ZONE; default: its first)"
    )
    cred = g.add_mutually_exclusive_group()
    cred.add_argument("--token", help="admin role token (env KVMESH_TOKEN)")
    cred.add_argument("--token-file", help="file holding the admin role token (env KVMESH_TOKEN_FILE)")
    cred.add_argument("--api-key", help="router API key of role admin (env KVMESH_API_KEY)")
    g.add_argument("--ca", help="CA to verify the servers with: TLS (env KVMESH_CA)")
    g.add_argument("--cert", help="client certificate for mTLS (env KVMESH_CERT)")
    g.add_argument("--key", help="client key for mTLS (env KVMESH_KEY)")
    g.add_argument("--timeout", type=float, default=10.0, help="seconds per call (default 10)")
    g.add_argument("--json", action="store_true", help="print one JSON document on stdout")


def _flag_security(args: argparse.Namespace) -> tuple[ChannelSecurity, bool, bool]:
    """The flags' (then the environment's) security, and whether they set a credential / TLS."""
    env = os.environ
    token = args.token or ""
    token_file = args.token_file or ""
    if not (token or token_file or args.api_key):
        token, token_file = env.get("KVMESH_TOKEN", ""), env.get("KVMESH_TOKEN_FILE", "")
    if token_file:
        try:
            token = read_own_token(token_file)
        except Exception as exc:  # FailedPrecondition naming the file
            raise AdminError(str(exc), EXIT_USAGE) from exc
    token = token or args.api_key or ("" if token_file else env.get("KVMESH_API_KEY", ""))
    ca = args.ca or env.get("KVMESH_CA", "")
    cert, key = args.cert or env.get("KVMESH_CERT", ""), args.key or env.get("KVMESH_KEY", "")
    if bool(cert) != bool(key):
        raise AdminError("--cert and --key go together (mTLS needs both)", EXIT_USAGE)
    if cert and not ca:
        raise AdminError("--cert/--key need --ca (the CA that signed the servers' certificates)", EXIT_USAGE)
    return ChannelSecurity(ca, cert, key, token), bool(token), bool(ca)


def _suite() -> tuple[dict[str, Any], Path] | None:
    path = state_path()
    try:
        return json.loads(path.read_text()), path
    except FileNotFoundError:
        return None
    except (OSError, ValueError) as exc:
        raise AdminError(f"cannot read the suite state {path}: {exc}", EXIT_USAGE) from exc


def _suite_security(state: dict[str, Any], who: str) -> ChannelSecurity:
    """The suite's credential of `who` (``admin``: the operator, ``client``: the demo client): its token, and
    its pair and the CA when the suite runs TLS."""
    auth = state.get("auth") or {}
    token_file = (auth.get("tokens") or {}).get(who, "")
    token = read_own_token(token_file) if token_file and Path(token_file).exists() else ""
    tls = auth.get("tls") or {}
    if tls:
        cert, key = tls[who]
        return ChannelSecurity(tls["ca"], cert, key, token)
    return ChannelSecurity(token=token)


def _zone(args: argparse.Namespace) -> str:
    return str(getattr(args, "zone", None) or os.environ.get("KVMESH_ZONE", ""))


def _with_flags(suite: ChannelSecurity, flagged: ChannelSecurity, has_cred: bool, has_tls: bool) -> ChannelSecurity:
    """The suite's credential, with what the flags give in its place (their TLS, their token)."""
    if has_tls:
        return replace(flagged, token=flagged.token if has_cred else suite.token)
    return replace(suite, token=flagged.token) if has_cred else suite


def _suite_services(state: dict[str, Any], service: str, zone: str, path: Path) -> list[dict[str, Any]]:
    """The suite's serving instances of `service` (of `zone` when given: AdminError naming the suite's zones when
    it has none there)."""
    found = [s for s in state.get("services", []) if s.get("name") == service and s.get("grpc")]
    if not zone:
        return found
    zones = sorted({str(s.get("zone", "")) for s in state.get("services", [])} - {""})
    if zone not in zones:
        raise AdminError(
            f"--zone {zone}: the suite in {path} has no zone {zone!r} (its zones: {', '.join(zones)})", EXIT_USAGE
        )
    return [s for s in found if s.get("zone") == zone]


def resolve(args: argparse.Namespace, service: str, required: bool = True, who: str = "admin") -> Target | None:
    """The target of `service`; None when it has no address and is not `required` (AdminError when it is). A
    service of the local suite (found by `--zone`, or an address given that is the suite's) gets the suite's
    credential of `who` (`_suite_security`) where flags give none."""
    flagged, has_cred, has_tls = _flag_security(args)
    found = _suite()
    given = getattr(args, service.replace("-", "_"), None)
    source = "flag" if given else "env"
    given = given or os.environ.get(_ENV[service], "")
    if given:
        own = found is not None and any(s.get("grpc") == given for s in found[0].get("services", []))
        sec = _with_flags(_suite_security(found[0], who), flagged, has_cred, has_tls) if own and found else flagged
        return Target(service, given, sec, source)
    if found is not None:
        state, path = found
        mine = _suite_services(state, service, _zone(args), path)
        if mine:
            sec = _with_flags(_suite_security(state, who), flagged, has_cred, has_tls)
            return Target(service, str(mine[0]["grpc"]), sec, str(path))
    if not required:
        return None
    where = f"no {service} in {path}" if found is not None else f"no local suite ({state_path()} is absent)"
    if found is not None and _zone(args):
        where = f"no {service} of zone {_zone(args)} in {path}"
    if found is not None and found[0].get("state") == "starting":
        where += " yet (the suite is starting: `kvmesh status`)"
    flag = f"--{service}"
    raise AdminError(f"{where}: start one with `kvmesh up`, or give {flag} HOST:PORT (or {_ENV[service]})", EXIT_USAGE)


def resolve_all(args: argparse.Namespace, service: str) -> list[Target]:
    """Every target of `service`: the one given by flag or environment, else each of the local suite's (of
    `--zone` when given), else none."""
    if getattr(args, service.replace("-", "_"), None) or os.environ.get(_ENV[service]):
        one = resolve(args, service)
        return [one] if one is not None else []
    found = _suite()
    if found is None:
        return []
    state, path = found
    flagged, has_cred, has_tls = _flag_security(args)
    sec = _with_flags(_suite_security(state, "admin"), flagged, has_cred, has_tls)
    return [Target(service, str(s["grpc"]), sec, str(path)) for s in _suite_services(state, service, _zone(args), path)]


def operator_token_file() -> str:
    """The local suite's operator token file, as its state names it ("" without a suite)."""
    try:
        found = _suite()
    except AdminError:
        return ""
    return str(((found[0].get("auth") or {}).get("tokens") or {}).get("admin", "")) if found else ""
