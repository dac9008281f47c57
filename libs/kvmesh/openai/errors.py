"""The one HTTP error table: domain error class -> (HTTP status, OpenAI error type), beside the gRPC one in
`kvmesh.rpc.errors`, and the body OpenAI shapes an error as: `{"error": {"message", "type", "param", "code"}}`.

`param` names the invalid field (InvalidArgument), `code` is the HTTP status (as vLLM sends it); a
ResourceExhausted answer carries `Retry-After` (whole seconds, at least 1). Anything that is not a
`KvmeshError` is a 500 with a generic message: internals never reach the client.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

from kvmesh.core import errors

INTERNAL = (500, "server_error")

HTTP_ERRORS: dict[type[errors.KvmeshError], tuple[int, str]] = {
    errors.InvalidArgument: (400, "invalid_request_error"),
    errors.Unauthenticated: (401, "authentication_error"),
    errors.PermissionDenied: (403, "permission_error"),
    errors.NotFound: (404, "not_found_error"),
    errors.FailedPrecondition: (409, "conflict_error"),
    errors.Aborted: (409, "conflict_error"),
    errors.ResourceExhausted: (429, "rate_limit_error"),
    errors.Unimplemented: (501, "not_implemented_error"),
    errors.Unavailable: (503, "service_unavailable"),
    errors.DeadlineExceeded: (504, "timeout_error"),
}


@dataclass(frozen=True, slots=True)
class HttpError:
    """An error as HTTP: status, JSON body and extra headers."""

    status: int
    body: dict[str, Any]
    headers: dict[str, str]


def status_and_type(exc: BaseException) -> tuple[int, str]:
    """HTTP status and OpenAI error type of an exception (the most specific class wins); 500 otherwise."""
    if isinstance(exc, NotImplementedError):
        return HTTP_ERRORS[errors.Unimplemented]
    for cls in type(exc).__mro__:
        hit = HTTP_ERRORS.get(cls)  # type: ignore[call-overload]
        if hit is not None:
            return hit
    return INTERNAL


def http_error(exc: BaseException) -> HttpError:
    """The HTTP answer for a raised exception."""
    status, etype = status_and_type(exc)
    message = exc.message if isinstance(exc, errors.KvmeshError) else "internal error"
    param = exc.field if isinstance(exc, errors.InvalidArgument) else None
    headers: dict[str, str] = {}
    if isinstance(exc, errors.ResourceExhausted):
        headers["Retry-After"] = str(max(1, math.ceil(exc.retry_after_s)))
    body = {"error": {"message": message, "type": etype, "param": param, "code": status}}
    return HttpError(status, body, headers)
