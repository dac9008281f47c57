"""The one error map: domain errors -> gRPC codes with rich details; anything else -> INTERNAL, no leak."""

from __future__ import annotations

import grpc
import pytest
from google.rpc import error_details_pb2, status_pb2

from kvmesh.core import errors
from kvmesh.openai.errors import HTTP_ERRORS, status_and_type
from kvmesh.rpc.errors import (
    _CODES,
    details_trailers,
    invalid_field,
    status_code_for,
    status_details,
    to_grpc_status,
)

pytestmark = pytest.mark.unit


def _details(status: grpc.Status) -> status_pb2.Status:
    raw = dict(status.trailing_metadata)["grpc-status-details-bin"]
    return status_pb2.Status.FromString(raw)


@pytest.mark.parametrize(
    ("exc", "code"),
    [
        (errors.InvalidArgument("f", "bad"), grpc.StatusCode.INVALID_ARGUMENT),
        (errors.ResourceExhausted("full", 1.5), grpc.StatusCode.RESOURCE_EXHAUSTED),
        (errors.Unavailable("down"), grpc.StatusCode.UNAVAILABLE),
        (errors.NotFound("x"), grpc.StatusCode.NOT_FOUND),
        (errors.FailedPrecondition("x"), grpc.StatusCode.FAILED_PRECONDITION),
        (errors.DeadlineExceeded("x"), grpc.StatusCode.DEADLINE_EXCEEDED),
        (errors.Unauthenticated("x"), grpc.StatusCode.UNAUTHENTICATED),
        (errors.Unimplemented("x"), grpc.StatusCode.UNIMPLEMENTED),
        (NotImplementedError(), grpc.StatusCode.UNIMPLEMENTED),
        (KeyError("secret internals"), grpc.StatusCode.INTERNAL),
    ],
)
def test_codes(exc: BaseException, code: grpc.StatusCode) -> None:
    assert status_code_for(exc) == code
    assert to_grpc_status(exc).code == code
    assert (status_and_type(exc)[0] == 500) == (code == grpc.StatusCode.INTERNAL)  # mapped over HTTP too


def test_http_table_covers_the_grpc_one() -> None:
    assert set(HTTP_ERRORS) == set(_CODES)


def test_invalid_argument_names_the_field() -> None:
    status = to_grpc_status(errors.InvalidArgument("sampling.top_p", "must be <= 1"), "rid")
    proto = _details(status)
    bad = error_details_pb2.BadRequest()
    assert proto.details[0].Unpack(bad)
    assert bad.field_violations[0].field == "sampling.top_p"
    assert "sampling.top_p" in status.details


def test_resource_exhausted_carries_retry_info_and_header() -> None:
    status = to_grpc_status(errors.ResourceExhausted("queue full", 2.25))
    info = error_details_pb2.RetryInfo()
    assert _details(status).details[0].Unpack(info)
    assert info.retry_delay.seconds == 2 and info.retry_delay.nanos == 250_000_000
    assert dict(status.trailing_metadata)["retry-after"] == "3"


def test_unexpected_errors_do_not_leak() -> None:
    status = to_grpc_status(RuntimeError("password=hunter2 at /srv/secret.py:12"), "req-1")
    assert "hunter2" not in status.details and "req-1" in status.details


def _call_error(status: grpc.Status, details: bytes) -> grpc.aio.AioRpcError:
    trailers = grpc.aio.Metadata(*details_trailers(details))
    return grpc.aio.AioRpcError(status.code, grpc.aio.Metadata(), trailers, details=status.details)


def test_a_status_carried_as_bytes_names_its_field_again() -> None:
    """What a stream's per-request error carries (`status_details`) rebuilds a call's trailers: the field
    reads back; none, or details of another status, read as the default."""
    status = to_grpc_status(errors.InvalidArgument("response_format", "no grammar here"), "rid")
    details = status_details(status)
    assert details and details_trailers(details) == (("grpc-status-details-bin", details),)
    assert invalid_field(_call_error(status, details)) == "response_format"
    internal = to_grpc_status(KeyError("x"))
    assert invalid_field(_call_error(internal, status_details(internal))) == "request"  # no BadRequest in it
    assert invalid_field(_call_error(internal, b"")) == "request"  # no details at all
    other = status_details(to_grpc_status(errors.InvalidArgument("n", "bad")))
    assert invalid_field(_call_error(status, other), default="?") == "?"  # details of another status
