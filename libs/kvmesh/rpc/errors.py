"""The one place that maps kvmesh domain errors to gRPC status codes (with `google.rpc` rich details).

INVALID_ARGUMENT carries a `google.rpc.BadRequest` naming the field; RESOURCE_EXHAUSTED carries a
`google.rpc.RetryInfo` and a `retry-after` trailer (seconds) for clients that don't parse details. A
request failing inside a stream of many (`GenerateStream`, generate frames) carries the same
`google.rpc.Status` in its message (`status_details`), and the router rebuilds a call's trailers from it
(`details_trailers`), so `bad_request_fields` / `invalid_field` read the field a worker named on every
transport.
Anything that is not a `KvmeshError` becomes INTERNAL with a generic message and the request id: the
stack trace goes to the log, never to the client. The HTTP table for the same classes (OpenAI-compatible
endpoints) is `kvmesh.openai.errors.HTTP_ERRORS`.
"""

from __future__ import annotations

import math

import grpc
from google.protobuf import any_pb2, duration_pb2
from google.rpc import code_pb2, error_details_pb2, status_pb2
from grpc_status import rpc_status

from kvmesh.core import errors

_DETAILS_KEY = "grpc-status-details-bin"  # where gRPC carries a status's google.rpc.Status

_CODES: dict[type[errors.KvmeshError], grpc.StatusCode] = {
    errors.InvalidArgument: grpc.StatusCode.INVALID_ARGUMENT,
    errors.ResourceExhausted: grpc.StatusCode.RESOURCE_EXHAUSTED,
    errors.Unavailable: grpc.StatusCode.UNAVAILABLE,
    errors.NotFound: grpc.StatusCode.NOT_FOUND,
    errors.FailedPrecondition: grpc.StatusCode.FAILED_PRECONDITION,
    errors.DeadlineExceeded: grpc.StatusCode.DEADLINE_EXCEEDED,
    errors.Unauthenticated: grpc.StatusCode.UNAUTHENTICATED,
    errors.PermissionDenied: grpc.StatusCode.PERMISSION_DENIED,
    errors.Unimplemented: grpc.StatusCode.UNIMPLEMENTED,
    errors.Aborted: grpc.StatusCode.ABORTED,
}


def status_code_for(exc: BaseException) -> grpc.StatusCode:
    """The gRPC code of a domain error (the most specific class wins); INTERNAL for anything else."""
    if isinstance(exc, NotImplementedError):
        return grpc.StatusCode.UNIMPLEMENTED
    for cls in type(exc).__mro__:
        code = _CODES.get(cls)  # type: ignore[arg-type]
        if code is not None:
            return code
    return grpc.StatusCode.INTERNAL


def to_grpc_status(exc: BaseException, request_id: str = "") -> grpc.Status:
    """Builds the status (code, message, rich details in trailers) for a raised exception."""
    code = status_code_for(exc)
    if isinstance(exc, errors.KvmeshError):
        message = exc.message
    elif isinstance(exc, NotImplementedError):
        message = "method not implemented by this service yet"
    else:
        message = f"internal error (request id {request_id or 'unknown'})"
    details: list[any_pb2.Any] = []
    extra_trailers: list[tuple[str, str]] = []
    if isinstance(exc, errors.InvalidArgument):
        bad = error_details_pb2.BadRequest(
            field_violations=[error_details_pb2.BadRequest.FieldViolation(field=exc.field, description=message)]
        )
        details.append(_pack(bad))
    if isinstance(exc, errors.ResourceExhausted):
        retry = max(exc.retry_after_s, 0.0)
        secs = math.floor(retry)
        info = error_details_pb2.RetryInfo(
            retry_delay=duration_pb2.Duration(seconds=secs, nanos=int((retry - secs) * 1e9))
        )
        details.append(_pack(info))
        extra_trailers.append(("retry-after", str(max(1, math.ceil(retry)))))
    if request_id:
        details.append(_pack(error_details_pb2.RequestInfo(request_id=request_id)))
    proto = status_pb2.Status(code=_code_value(code), message=message, details=details)
    status = rpc_status.to_status(proto)
    if extra_trailers:
        return _Status(status.code, status.details, tuple(status.trailing_metadata) + tuple(extra_trailers))
    return status


def status_details(status: grpc.Status) -> bytes:
    """The serialised `google.rpc.Status` a status built by `to_grpc_status` carries in its trailers (its
    rich details); b"" when it has none."""
    for key, value in status.trailing_metadata or ():
        if key == _DETAILS_KEY and isinstance(value, bytes):
            return value
    return b""


def details_trailers(details: bytes) -> tuple[tuple[str, bytes], ...]:
    """The trailing metadata of a failed call that carried `details` (`status_details`); () for none."""
    return ((_DETAILS_KEY, details),) if details else ()


def invalid_field(err: grpc.aio.AioRpcError | grpc.RpcError, default: str = "request") -> str:
    """The field a failed call's BadRequest names first; `default` when it names none (or its details do
    not match its status: unreadable, never a failure of their own)."""
    try:
        fields = bad_request_fields(err)
    except ValueError:
        return default
    return next((f for f in fields if f), default)


def retry_after_s(err: grpc.aio.AioRpcError | grpc.RpcError) -> float | None:
    """Reads RetryInfo from a failed call's trailers (client side), or None."""
    status = rpc_status.from_call(err)  # type: ignore[arg-type]
    if status is None:
        return None
    for detail in status.details:
        if detail.Is(error_details_pb2.RetryInfo.DESCRIPTOR):
            info = error_details_pb2.RetryInfo()
            detail.Unpack(info)
            return info.retry_delay.seconds + info.retry_delay.nanos / 1e9
    return None


def bad_request_fields(err: grpc.aio.AioRpcError | grpc.RpcError) -> list[str]:
    """The field names of a BadRequest detail (client side)."""
    status = rpc_status.from_call(err)  # type: ignore[arg-type]
    fields: list[str] = []
    if status is None:
        return fields
    for detail in status.details:
        if detail.Is(error_details_pb2.BadRequest.DESCRIPTOR):
            bad = error_details_pb2.BadRequest()
            detail.Unpack(bad)
            fields.extend(v.field for v in bad.field_violations)
    return fields


def _pack(message: object) -> any_pb2.Any:
    packed = any_pb2.Any()
    packed.Pack(message)  # type: ignore[arg-type]
    return packed


def _code_value(code: grpc.StatusCode) -> int:
    value = code.value[0]
    assert isinstance(value, int)
    return value if value in code_pb2.Code.values() else code_pb2.INTERNAL


class _Status(grpc.Status):
    def __init__(self, code: grpc.StatusCode, details: str, trailing_metadata: tuple[tuple[str, str], ...]):
        self.code = code
        self.details = details
        self.trailing_metadata = trailing_metadata
