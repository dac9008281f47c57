"""ReportRoutedPrefixes over real gRPC (the servicer in-process, as in test_cache_manager_publisher_roles):
a batch out of bounds is INVALID_ARGUMENT naming the field and nothing of it is counted; a routed prompt's
report counts in the prefix statistics and hit ratio exactly as a FindMatches query of that prompt does.
Who may call it is the authorisation table's row (test_security_authz, test_authz_table)."""

from __future__ import annotations

import grpc
import pytest

from kvmesh.cachemgr.routed import MAX_ROUTED_PREFIXES, MAX_ROUTED_TOKENS
from kvmesh.ops.warming.stats import checkpoint_keys
from kvmesh.security.identity import CallerRole, Identity
from kvmesh.v1 import cache_manager_pb2 as pb
from kvmesh.v1 import cache_manager_pb2_grpc, common_pb2
from tests.integration.cache_manager.test_publisher_roles import (
    BS,
    PROMPT,
    CacheManagerInProcess,
    hello,
    live,
    publish,
)
from tests.unit.cachemgr.test_ingest_state import ToyEngine

pytestmark = pytest.mark.integration
X = Identity(CallerRole.WORKER, "worker-x")


def routed_prefix(hashes: list[int], hit_blocks: int) -> pb.RoutedPrefix:
    """The entry a router reports for a prompt of index block `hashes` (`kvmesh.services.router.prefix_reports`)."""
    return pb.RoutedPrefix(blocks=len(hashes), checkpoint_hashes=checkpoint_keys(hashes), hit_blocks=hit_blocks)


async def report(stub: cache_manager_pb2_grpc.CacheManagerServiceStub, *entries: pb.RoutedPrefix) -> int:
    resp = await stub.ReportRoutedPrefixes(pb.ReportRoutedPrefixesRequest(prefixes=entries), timeout=10)
    return resp.accepted


@pytest.mark.parametrize(
    ("entries", "field"),
    [
        ([routed_prefix([1], 0)] * (MAX_ROUTED_PREFIXES + 1), "prefixes"),
        (
            [routed_prefix([1, 2, 3], 1), pb.RoutedPrefix(blocks=3, checkpoint_hashes=[1, 2])],
            "prefixes[1].checkpoint_hashes",
        ),
        ([pb.RoutedPrefix(blocks=0)], "prefixes[0].blocks"),
        ([pb.RoutedPrefix(blocks=(1 << 20) + 1, checkpoint_hashes=[0] * 22)], "prefixes[0].blocks"),
        ([routed_prefix([1, 2], 3)], "prefixes[0].hit_blocks"),
        (
            [pb.RoutedPrefix(blocks=1, checkpoint_hashes=[1], token_ids=[0] * (MAX_ROUTED_TOKENS + 1))],
            "prefixes[0].token_ids",
        ),
    ],
)
async def test_a_batch_out_of_bounds_is_refused_naming_the_field(entries: list[pb.RoutedPrefix], field: str) -> None:
    cm = CacheManagerInProcess()
    async with cm as stub:
        with pytest.raises(grpc.aio.AioRpcError) as ei:
            await report(stub, *entries)
        assert ei.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert (ei.value.details() or "").startswith(f"{field}:")
        assert cm.core.queries.queries == 0 and not cm.core.stats.info  # checked whole, before any is counted


def stats_of(resp: pb.GetStatsResponse) -> tuple[float, list[tuple[int, int, int, int, str]]]:
    """Hit ratio and top prefixes (without their times)."""
    return resp.hit_ratio, [(p.key, p.blocks, p.window_count, p.total, p.tenant) for p in resp.top_prefixes]


async def test_a_report_counts_as_the_find_matches_query_of_the_same_prompt() -> None:
    eng = ToyEngine(X.id, None, seed=1)
    queried, routed = CacheManagerInProcess(), CacheManagerInProcess()
    async with queried as q_stub, routed as r_stub:
        longer = PROMPT + list(range(700, 748))  # 4 blocks held, then 12 that no worker holds
        for stub in (q_stub, r_stub):
            await publish(stub, [hello(X.id, eng.instance), live(eng.prompt(PROMPT))], X)
        req = pb.FindMatchesRequest(token_ids=common_pb2.TokenIds(ids=longer))
        for _ in range(2):
            found = await q_stub.FindMatches(req, timeout=10)
        hit = max(m.matched_blocks for m in found.matches)
        hashes = routed.core.hashes_of(longer)
        assert (len(hashes), hit) == (found.total_blocks, 4)
        assert await report(r_stub, routed_prefix(hashes, hit), routed_prefix(hashes, hit)) == 2

        want = stats_of(await q_stub.GetStats(pb.GetStatsRequest(top_prefixes=10), timeout=10))
        got = stats_of(await r_stub.GetStats(pb.GetStatsRequest(top_prefixes=10), timeout=10))
        assert got == want and got[0] == 4 / 16
        assert got[1][0][:3] == (hashes[-1], 16, 2)  # the whole prompt, twice (longest first among equals)


async def test_a_report_s_token_ids_are_kept_for_the_prefixes_they_cover() -> None:
    """Warming and replication need a prefix's tokens: kept for each checkpoint the reported ids cover whole."""
    cm = CacheManagerInProcess()
    async with cm as stub:
        prompt = list(range(1, 4 * BS + 3))  # 4 full blocks and 2 more tokens
        hashes = cm.core.hashes_of(prompt)
        entry = routed_prefix(hashes, 0)
        entry.token_ids.extend(prompt[: 2 * BS + 1])  # shortened by the router's cap: covers blocks 1 and 2
        assert await report(stub, entry) == 1
        kept = {inf.n_blocks: inf.token_ids for inf in cm.core.stats.info.values()}
        assert kept == {1: tuple(prompt[:BS]), 2: tuple(prompt[: 2 * BS]), 4: None}
