"""What the router's two worker transports share (`kvmesh.services.router.stream_requests`): the start and cancel
messages both write parse to the `GenerateStreamRequest` they stand for, and a worker's `error_code` maps back
to the gRPC status a `Generate` call would have ended with."""

from __future__ import annotations

import grpc
import pytest

from kvmesh.services.router.stream_requests import cancel_message, start_message, status_code
from kvmesh.v1 import common_pb2, worker_pb2

pytestmark = pytest.mark.unit


@pytest.mark.parametrize("traceparent", ["", "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01"])
def test_start_message_is_the_generate_stream_request_it_stands_for(traceparent: str) -> None:
    req = worker_pb2.GenerateRequest(request_id="r1", token_ids=common_pb2.TokenIds(ids=[1, 2, 70000]))
    got = worker_pb2.GenerateStreamRequest.FromString(start_message(req.SerializeToString(), traceparent))
    assert got == worker_pb2.GenerateStreamRequest(start=req, traceparent=traceparent)


def test_cancel_message_names_the_request() -> None:
    got = worker_pb2.GenerateStreamRequest.FromString(cancel_message("r9"))
    assert got.WhichOneof("action") == "cancel_request_id" and got.cancel_request_id == "r9"


@pytest.mark.parametrize("code", list(grpc.StatusCode))
def test_status_code_maps_every_grpc_code_back(code: grpc.StatusCode) -> None:
    assert status_code(code.value[0]) is code


def test_an_unknown_error_code_is_unknown() -> None:
    assert status_code(999) is grpc.StatusCode.UNKNOWN
