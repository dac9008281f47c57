"""ReplicatePrefixes over real gRPC (the servicer in-process, as in test_cache_manager_publisher_roles): a
request out of bounds is INVALID_ARGUMENT naming the field, before any worker is asked; a zone with no
worker answers each prefix with an error, never a verified replica. The end-to-end path (pull, verify,
partition) is tests/integration/cache_manager/test_zone_replication.py; who may call it is the authorisation table."""

from __future__ import annotations

import grpc
import pytest

from kvmesh.services.cache_manager.replication import MAX_PREFIX_TOKENS, MAX_PREFIXES
from kvmesh.v1 import cache_manager_pb2 as pb
from kvmesh.v1 import common_pb2
from tests.integration.cache_manager.test_publisher_roles import BS, CacheManagerInProcess

pytestmark = pytest.mark.integration


def prefix(n: int = 64, address: str = "10.0.0.1:7000", region: str = "cpu") -> pb.ReplicaPrefix:
    return pb.ReplicaPrefix(
        prompt=common_pb2.TokenIds(ids=list(range(n))), source_worker_id="w", source_address=address, region=region
    )


@pytest.mark.parametrize(
    ("request_", "field"),
    [
        (pb.ReplicatePrefixesRequest(source_zone="a", prefixes=[prefix()] * (MAX_PREFIXES + 1)), "prefixes"),
        (pb.ReplicatePrefixesRequest(source_zone="a"), "prefixes"),
        (pb.ReplicatePrefixesRequest(prefixes=[prefix()]), "source_zone"),
        (pb.ReplicatePrefixesRequest(source_zone="a", prefixes=[prefix(), prefix(0)]), "prefixes[1].prompt.ids"),
        (
            pb.ReplicatePrefixesRequest(source_zone="a", prefixes=[prefix(MAX_PREFIX_TOKENS + 1)]),
            "prefixes[0].prompt.ids",
        ),
        (pb.ReplicatePrefixesRequest(source_zone="a", prefixes=[prefix(address="")]), "prefixes[0].source_address"),
        (pb.ReplicatePrefixesRequest(source_zone="a", prefixes=[prefix(region="")]), "prefixes[0].region"),
    ],
)
async def test_a_request_out_of_bounds_is_refused_naming_the_field(
    request_: pb.ReplicatePrefixesRequest, field: str
) -> None:
    cm = CacheManagerInProcess()
    async with cm as stub:
        with pytest.raises(grpc.aio.AioRpcError) as ei:
            await stub.ReplicatePrefixes(request_, timeout=10)
        assert ei.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert (ei.value.details() or "").startswith(f"{field}:")
        assert cm.warmer.actions_total == 0


async def test_a_zone_without_workers_answers_an_error_per_prefix() -> None:
    cm = CacheManagerInProcess()
    async with cm as stub:
        req = pb.ReplicatePrefixesRequest(source_zone="a", prefixes=[prefix(65), prefix(16)])
        resp = await stub.ReplicatePrefixes(req, timeout=10)
        assert [(r.worker_id, r.blocks, r.blocks_expected, r.already_held) for r in resp.results] == [
            ("", 0, 64 // BS, False),  # full blocks before the last token: that one is computed
            ("", 0, 15 // BS, False),
        ]
        assert all("no worker" in r.error for r in resp.results)
