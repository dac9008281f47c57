"""The audit log: one structured line per admin action, on its own logger (``kvmesh.audit``).

Each line is a JSON object ``{"audit": 1, "service", "who", "action", "args", "when", "result"}``:

* ``who``: the caller's identity (``role:id``, `kvmesh.security.identity.Identity.__str__`) or ``anonymous``
  when the service runs without authentication;
* ``action``: the gRPC method (``CacheManagerService/Checkpoint``) or HTTP route (``POST /admin/drain``);
* ``args``: the key arguments (never secrets or prompts);
* ``when``: UTC ISO-8601 time of the decision;
* ``result``: ``ok``, or the gRPC status code name of the refusal or failure (``PERMISSION_DENIED``,
  ``INVALID_ARGUMENT``, …; HTTP routes log the same names, e.g. ``UNSUPPORTED_MEDIA_TYPE`` for a 415).

The logger is ``kvmesh.audit`` so operators can route it (a file, a SIEM) apart from the service log; it
logs at INFO, is exempt from the services' repeat limit (`kvmesh.telemetry.logging.UNLIMITED`: no admin
action goes unlogged) and carries no secrets. Every admin handler of every service uses :func:`audited`.
"""

from __future__ import annotations

import asyncio
import contextlib
import datetime
import json
import logging
from collections.abc import Iterator, Mapping

from kvmesh.rpc.errors import status_code_for
from kvmesh.security.identity import current_identity
from kvmesh.telemetry.logging import UNLIMITED

AUDIT_LOGGER = "kvmesh.audit"
log = logging.getLogger(AUDIT_LOGGER)
ANONYMOUS = "anonymous"


def caller() -> str:
    """The current caller as the audit log names it."""
    ident = current_identity()
    return str(ident) if ident is not None else ANONYMOUS


def audit_line(service: str, who: str, action: str, args: Mapping[str, object], when: str, result: str) -> str:
    """One audit record as a JSON line (keys sorted, so lines are stable and greppable)."""
    rec = {"audit": 1, "service": service, "who": who, "action": action, "args": dict(args), "when": when}
    rec["result"] = result
    return json.dumps(rec, sort_keys=True, default=str)


def record(service: str, action: str, args: Mapping[str, object], result: str, who: str | None = None) -> None:
    """Log one admin action (``who`` defaults to the current caller)."""
    when = datetime.datetime.now(datetime.UTC).isoformat(timespec="milliseconds")
    log.info("%s", audit_line(service, who or caller(), action, args, when, result), extra={UNLIMITED: True})


def result_of(exc: BaseException) -> str:
    """The result name of a failed action: its `audit_result` when it has one, else its gRPC status code name
    (CANCELLED for a cancelled call)."""
    if isinstance(exc, asyncio.CancelledError):
        return "CANCELLED"
    named = getattr(exc, "audit_result", None)
    return named if isinstance(named, str) else status_code_for(exc).name


@contextlib.contextmanager
def audited(service: str, action: str, **args: object) -> Iterator[dict[str, object]]:
    """Audit the enclosed admin action: ``ok`` when it completes, else the code of what it raised (re-raised).
    The yielded dict takes arguments known only inside (e.g. a parsed body's fields)."""
    extra: dict[str, object] = dict(args)
    try:
        yield extra
    except BaseException as e:
        record(service, action, extra, result_of(e))
        raise
    record(service, action, extra, "ok")
