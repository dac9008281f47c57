"""What a failed `kvmesh` command prints: one line on stderr naming the cause and what to do, and an exit code;
never a traceback (`kvmesh.suite.cli.main` runs every command under `explain`).

A gRPC error names its code, the service's words and the fix its code calls for; an HTTP error (the OpenAI
API) its status and the error's message; an `AdminError` is already one line; a `KvmeshError` or an `OSError`
(a file that cannot be read, a refused connection, a TLS handshake the CA does not verify) its message;
anything else its type and message. The exit codes are the admin commands' (`kvmesh.suite.admin.target`):
1 failed, 2 usage, 3 denied, 4 unreachable.
"""

from __future__ import annotations

import json
import ssl
import urllib.error

import grpc

from kvmesh.core.errors import FailedPrecondition, KvmeshError
from kvmesh.suite.admin.target import EXIT_DENIED, EXIT_FAILED, EXIT_UNREACHABLE, EXIT_USAGE, AdminError

CREDENTIAL_HINT = (
    "give a credential: --api-key KEY or --token-file FILE (a local suite's own are in $KVMESH_HOME/run/auth)"
)
_GRPC: dict[grpc.StatusCode, tuple[str, int]] = {
    grpc.StatusCode.UNAUTHENTICATED: (CREDENTIAL_HINT, EXIT_DENIED),
    grpc.StatusCode.PERMISSION_DENIED: (
        "use a credential whose role and tenants allow it (docs/security.md)",
        EXIT_DENIED,
    ),
    grpc.StatusCode.UNAVAILABLE: (
        "is the suite running (`kvmesh status`)? With TLS, --ca/--cert/--key must be the suite's (run/pki)",
        EXIT_UNREACHABLE,
    ),
    grpc.StatusCode.DEADLINE_EXCEEDED: ("no answer in time: `kvmesh status`, `kvmesh logs SERVICE`", EXIT_UNREACHABLE),
}
_HTTP = {401: (CREDENTIAL_HINT, EXIT_DENIED), 403: _GRPC[grpc.StatusCode.PERMISSION_DENIED]}


def _http_message(err: urllib.error.HTTPError) -> str:
    """The OpenAI error body's message, else the reason phrase."""
    try:
        return str(json.loads(err.read())["error"]["message"])
    except (OSError, ValueError, KeyError, TypeError):
        return str(err.reason)


def explain(exc: Exception) -> tuple[str, int]:
    """The line (without the command's name) and the exit code of a command that raised `exc`."""
    if isinstance(exc, AdminError):
        return str(exc), exc.exit_code
    if isinstance(exc, grpc.RpcError) and callable(getattr(exc, "code", None)):
        code: grpc.StatusCode = exc.code()  # type: ignore[attr-defined]
        details = exc.details() or ""  # type: ignore[attr-defined]
        hint, exit_code = _GRPC.get(code, ("", EXIT_FAILED))
        return f"{code.name}: {details}" + (f"; {hint}" if hint else ""), exit_code
    if isinstance(exc, urllib.error.HTTPError):
        hint, exit_code = _HTTP.get(exc.code, ("", EXIT_FAILED))
        return f"{exc.url}: HTTP {exc.code}: {_http_message(exc)}" + (f"; {hint}" if hint else ""), exit_code
    if isinstance(exc, FailedPrecondition):
        return exc.message, EXIT_USAGE
    if isinstance(exc, KvmeshError):
        return exc.message, EXIT_FAILED
    if isinstance(exc, urllib.error.URLError):  # the connection, not an HTTP answer
        reason = exc.reason
        if isinstance(reason, ssl.SSLError):
            return f"TLS: {reason}: the server's certificate must be signed by the CA given (run/pki/ca.pem)", (
                EXIT_UNREACHABLE
            )
        return f"cannot reach the server: {reason}; is the suite running (`kvmesh status`)?", EXIT_UNREACHABLE
    if isinstance(exc, OSError):
        where = f": {exc.filename}" if exc.filename else ""
        return f"{exc.strerror or exc}{where}", EXIT_FAILED
    return f"unexpected {type(exc).__name__}: {exc}", EXIT_FAILED
