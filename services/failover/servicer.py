"""Failover servicer: proto <-> domain over kvmesh.discovery."""

from __future__ import annotations

import grpc
from kvmesh.errors import Unimplemented
from kvmesh.rpc.validate import in_range, require
from kvmesh.v1 import failover_pb2, failover_pb2_grpc


def validate_weight_map(weights: dict[str, float], field: str) -> None:
    """Non-negative finite weights with a positive total (an empty map means "unchanged")."""
    if not weights:
        return
    for key, value in weights.items():
        in_range(value, f"{field}[{key}]", 0.0)
    require(sum(weights.values()) > 0, field, "weights must have a positive total")


class FailoverServicer(failover_pb2_grpc.FailoverServiceServicer):
    """Discovery, zone health and traffic weights."""

    async def SetTrafficWeights(  # type: ignore[override]
        self, request: failover_pb2.SetTrafficWeightsRequest, context: grpc.aio.ServicerContext
    ) -> failover_pb2.SetTrafficWeightsResponse:
        validate_weight_map(dict(request.weights.zone_weights), "weights.zone_weights")
        validate_weight_map(dict(request.weights.version_weights), "weights.version_weights")
        raise Unimplemented("traffic weights are not implemented yet")
