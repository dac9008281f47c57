"""Cache-manager servicer: proto <-> domain over the prefix index (kvmesh.index) and kvmesh.cachemgr."""

from __future__ import annotations

import grpc
from kvmesh.errors import Unimplemented
from kvmesh.rpc.validate import require
from kvmesh.v1 import cache_manager_pb2, cache_manager_pb2_grpc


def validate_find_matches(request: cache_manager_pb2.FindMatchesRequest) -> None:
    """A query needs tokens or hashes."""
    require(request.WhichOneof("query") is not None, "query", "one of token_ids or block_hashes is required")


class CacheManagerServicer(cache_manager_pb2_grpc.CacheManagerServiceServicer):
    """The zone's KV prefix index."""

    async def FindMatches(  # type: ignore[override]
        self, request: cache_manager_pb2.FindMatchesRequest, context: grpc.aio.ServicerContext
    ) -> cache_manager_pb2.FindMatchesResponse:
        validate_find_matches(request)
        raise Unimplemented("the index is not wired yet")
