"""What the router's two worker transports share (`kvmesh.services.router.stream_requests`): the start and cancel
messages both write parse to the `GenerateStreamRequest` they stand for, and a worker's `error_code` maps back
to the gRPC status a `Generate` call would have ended with, its `error_status` to that call's rich details (the
field a refusal names, a retry delay)."""

from __future__ import annotations

import grpc
import pytest

from kvmesh.core.errors import InvalidArgument, ResourceExhausted
from kvmesh.rpc.errors import invalid_field, retry_after_s, status_details, to_grpc_status
from kvmesh.services.router.stream_requests import (
    StreamedRequest,
    cancel_message,
    start_message,
    status_code,
)
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


class _Carrier:
    def forget(self, request_id: str, req: StreamedRequest) -> None:
        pass

    def send_cancel(self, request_id: str) -> None:
        pass


async def _raised(msg: worker_pb2.GenerateStreamResponse) -> grpc.aio.AioRpcError:
    req = StreamedRequest(_Carrier(), msg.request_id, None)
    req.deliver(msg)
    with pytest.raises(grpc.aio.AioRpcError) as ei:
        async for _ in req:
            pass
    return ei.value


def _failed(exc: Exception, with_status: bool = True) -> worker_pb2.GenerateStreamResponse:
    """A worker's message for a request that failed with `exc` (as services/worker/generate_stream.py writes it)."""
    st = to_grpc_status(exc, "r1")
    status = status_details(st) if with_status else b""
    return worker_pb2.GenerateStreamResponse(
        request_id="r1", error_code=st.code.value[0], error_message=st.details, error_status=status
    )


async def test_a_worker_refusal_keeps_the_field_it_named_and_a_retry_its_delay() -> None:
    refused = await _raised(_failed(InvalidArgument("structured_outputs", "synthetic tokens")))
    assert refused.code() is grpc.StatusCode.INVALID_ARGUMENT and invalid_field(refused) == "structured_outputs"
    full = await _raised(_failed(ResourceExhausted("queue full", 2.5)))
    assert full.code() is grpc.StatusCode.RESOURCE_EXHAUSTED and retry_after_s(full) == 2.5
    # a worker from before `error_status`: the code and message only, the field unknown
    old = await _raised(_failed(InvalidArgument("structured_outputs", "x"), with_status=False))
    assert old.code() is grpc.StatusCode.INVALID_ARGUMENT and invalid_field(old) == "request"


@pytest.mark.parametrize("sequences", [1, 2, 3])
async def test_the_request_ends_with_the_finish_of_its_last_sequence(sequences: int) -> None:
    """With n sequences each one's last step has a finish reason: the handle stops after the n-th, not the
    first (ending at the first would cut the other sequences off and send them to another worker)."""
    req = StreamedRequest(_Carrier(), "r1", None, sequences)
    stop = common_pb2.FINISH_REASON_STOP
    steps = [(i, f) for i in range(sequences) for f in (0, stop)]  # each sequence: a token, then its finish
    for index, finish in steps:
        step = worker_pb2.GenerateResponse(token_ids=[7], index=index, finish_reason=finish)  # type: ignore[arg-type]
        req.deliver(worker_pb2.GenerateStreamResponse(request_id="r1", response=step))
    req.deliver(worker_pb2.GenerateStreamResponse(request_id="r1", response=worker_pb2.GenerateResponse(index=9)))
    got = [(s.index, s.finish_reason) async for s in req]
    assert got == steps and req.done()  # the stray step after the last finish is never read
