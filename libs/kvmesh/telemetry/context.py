"""Per-request context carried through asyncio tasks: request id and absolute deadline.

Set by the server interceptor from incoming metadata and the call's deadline; read by loggers and by
outbound calls, which propagate both (`x-request-id` metadata, the remaining time as their timeout).
"""

from __future__ import annotations

import contextvars
import time
import uuid

REQUEST_ID_HEADER = "x-request-id"

request_id_var: contextvars.ContextVar[str] = contextvars.ContextVar("kvmesh_request_id", default="")
deadline_var: contextvars.ContextVar[float | None] = contextvars.ContextVar("kvmesh_deadline", default=None)


def new_request_id() -> str:
    """A fresh request id (32 hex chars)."""
    return uuid.uuid4().hex


def remaining_s(default: float | None = None) -> float | None:
    """Seconds left before the current request's deadline (never below 0), or `default` if none is set."""
    deadline = deadline_var.get()
    if deadline is None:
        return default
    return max(0.0, deadline - time.monotonic())


def outbound_timeout(default: float | None) -> float | None:
    """Timeout for a call made on behalf of the current request: the smaller of its remaining time and `default`."""
    left = remaining_s()
    if left is None:
        return default
    return left if default is None else min(left, default)
