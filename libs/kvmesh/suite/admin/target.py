"""Where the admin CLI connects, and as whom.

Addresses, per service: ``--router`` / ``--failover`` / ``--cache-manager``, else ``KVMESH_ROUTER`` /
``KVMESH_FAILOVER`` / ``KVMESH_CACHE_MANAGER``, else the local suite's state file (``run/suite.json`` that
`kvmesh up` writes under ``$KVMESH_HOME``).

Credentials: ``--token`` / ``--token-file`` (a role token, ``KVMESH_TOKEN`` / ``KVMESH_TOKEN_FILE``) or
``--api-key`` (a router API key of role admin, ``KVMESH_API_KEY``), sent as the bearer token; TLS with ``--ca``
(``KVMESH_CA``) and, for mTLS, ``--cert``/``--key`` (``KVMESH_CERT``/``KVMESH_KEY``). A service found in the
local suite's state gets the suite's operator credential (its admin token, and its admin certificate when the
suite runs TLS) where the flags give none; a suite credential is never sent to an address given by hand.
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

SERVICES = ("router", "failover", "cache-manager")
_ENV = {"router": "KVMESH_ROUTER", "failover": "KVMESH_FAILOVER", "cache-manager": "KVMESH_CACHE_MANAGER"}


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


def _suite_security(state: dict[str, Any]) -> ChannelSecurity:
    """The suite's operator credential: its admin token, and its admin pair and CA when it runs TLS."""
    auth = state.get("auth") or {}
    token_file = (auth.get("tokens") or {}).get("admin", "")
    token = read_own_token(token_file) if token_file and Path(token_file).exists() else ""
    tls = auth.get("tls") or {}
    if tls:
        cert, key = tls["admin"]
        return ChannelSecurity(tls["ca"], cert, key, token)
    return ChannelSecurity(token=token)


def resolve(args: argparse.Namespace, service: str, required: bool = True) -> Target | None:
    """The target of `service`; None when it has no address and is not `required` (AdminError when it is)."""
    flagged, has_cred, has_tls = _flag_security(args)
    given = getattr(args, service.replace("-", "_"), None)
    if given:
        return Target(service, given, flagged, "flag")
    if os.environ.get(_ENV[service]):
        return Target(service, os.environ[_ENV[service]], flagged, "env")
    found = _suite()
    if found is not None:
        state, path = found
        address = next((s["grpc"] for s in state.get("services", []) if s.get("name") == service), None)
        if address:
            sec = _suite_security(state)
            if has_tls:
                sec = replace(flagged, token=flagged.token if has_cred else sec.token)
            elif has_cred:
                sec = replace(sec, token=flagged.token)
            return Target(service, address, sec, str(path))
    if not required:
        return None
    where = f"no {service} in {path}" if found is not None else f"no local suite ({state_path()} is absent)"
    flag = f"--{service}"
    raise AdminError(f"{where}: start one with `kvmesh up`, or give {flag} HOST:PORT (or {_ENV[service]})", EXIT_USAGE)
