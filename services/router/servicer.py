"""Router servicers: proto <-> domain. Routing itself lives in kvmesh.routing (pure)."""

from __future__ import annotations

from collections.abc import AsyncIterator

import grpc
from kvmesh.errors import Unimplemented
from kvmesh.rpc.validate import in_range, non_empty, require
from kvmesh.v1 import router_pb2, router_pb2_grpc


def validate_generate(request: router_pb2.RouterServiceGenerateRequest) -> None:
    """Checks a client request before any work is done."""
    require(request.WhichOneof("prompt") is not None, "prompt", "one of text, token_ids or chat is required")
    in_range(request.sampling.temperature, "sampling.temperature", 0.0, 10.0)
    in_range(request.sampling.top_p, "sampling.top_p", 0.0, 1.0)


def validate_weights(prefill_weight: float, decode_weight: float) -> None:
    """Routing weights are non-negative with a positive total."""
    in_range(prefill_weight, "prefill_weight", 0.0)
    in_range(decode_weight, "decode_weight", 0.0)
    require(prefill_weight + decode_weight > 0, "prefill_weight", "prefill_weight + decode_weight must be > 0")


class RouterServicer(router_pb2_grpc.RouterServiceServicer):
    """Client-facing generation."""

    async def Generate(  # type: ignore[override]
        self, request: router_pb2.RouterServiceGenerateRequest, context: grpc.aio.ServicerContext
    ) -> AsyncIterator[router_pb2.RouterServiceGenerateResponse]:
        validate_generate(request)
        raise Unimplemented("routing is not implemented yet")
        yield  # pragma: no cover - makes this an async generator


class RouterAdminServicer(router_pb2_grpc.RouterAdminServiceServicer):
    """Operator controls."""

    async def Rebalance(  # type: ignore[override]
        self, request: router_pb2.RebalanceRequest, context: grpc.aio.ServicerContext
    ) -> router_pb2.RebalanceResponse:
        validate_weights(request.prefill_weight, request.decode_weight)
        raise Unimplemented("rebalance is not implemented yet")

    async def DrainWorker(  # type: ignore[override]
        self, request: router_pb2.DrainWorkerRequest, context: grpc.aio.ServicerContext
    ) -> router_pb2.DrainWorkerResponse:
        non_empty(request.worker_id, "worker_id")
        raise Unimplemented("drain is not implemented yet")
