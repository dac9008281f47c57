"""Worker servicer: proto <-> domain over an Engine (kvmesh.engine)."""

from __future__ import annotations

from collections.abc import AsyncIterator

import grpc
from kvmesh.errors import Unimplemented
from kvmesh.rpc.validate import in_range, non_empty, require
from kvmesh.v1 import worker_pb2, worker_pb2_grpc


def validate_generate(request: worker_pb2.GenerateRequest) -> None:
    """Checks a generation request before the engine sees it."""
    non_empty(request.request_id, "request_id")
    kind = request.WhichOneof("prompt")
    require(kind is not None, "prompt", "one of token_ids or text is required")
    if kind == "token_ids":
        non_empty(request.token_ids.ids, "token_ids.ids")
    in_range(request.sampling.temperature, "sampling.temperature", 0.0, 10.0)
    in_range(request.sampling.top_p, "sampling.top_p", 0.0, 1.0)


class WorkerServicer(worker_pb2_grpc.WorkerServiceServicer):
    """One engine behind gRPC."""

    async def Generate(  # type: ignore[override]
        self, request: worker_pb2.GenerateRequest, context: grpc.aio.ServicerContext
    ) -> AsyncIterator[worker_pb2.GenerateResponse]:
        validate_generate(request)
        raise Unimplemented("no engine is wired yet")
        yield  # pragma: no cover

    async def Abort(  # type: ignore[override]
        self, request: worker_pb2.AbortRequest, context: grpc.aio.ServicerContext
    ) -> worker_pb2.AbortResponse:
        non_empty(request.request_id, "request_id")
        raise Unimplemented("no engine is wired yet")
