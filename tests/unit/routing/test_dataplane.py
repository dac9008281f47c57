"""The one pricer of tiers and pulls (`kvmesh.routing.dataplane`), as the live router uses it: a long prefix on a
serving peer is pulled with its terms, only the blocks the worker lacks, never from a worker that is not a
pull source, never past the margin; pending pulls (`kvmesh.routing.inflight.PendingPulls`) cover a prefix
until their hint expires."""

from __future__ import annotations

import pytest

from kvmesh.routing.dataplane import (
    DEFAULT_FIGURES,
    TransferFigures,
    plan_prefix,
    pull_seconds,
    sources_of,
    transfer_costs,
    vllm_cpu_costs,
)
from kvmesh.routing.inflight import PendingPull, PendingPulls
from kvmesh.routing.types import RoutingQuery, WorkerView

pytestmark = pytest.mark.unit
BS = 16
COSTS = transfer_costs(BS)


def query(
    prompt: int, tiers: dict[str, int], sources: dict[str, int] | None = None, margin: float = 2.0
) -> RoutingQuery:
    gpu = dict.fromkeys(tiers, 0)
    return RoutingQuery(
        "r", prompt, matches=gpu, block_size=BS, tier_matches=tiers, peer_pulls=True, pull_sources=sources,
        pull_margin=margin,
    )  # fmt: skip


def plan(q: RoutingQuery, wid: str = "b") -> tuple[int, int, str | None]:
    p = plan_prefix(q, WorkerView(wid, transfer=COSTS), sources_of(q))
    return p.load_blocks, p.pull_blocks, p.source


def test_a_long_prefix_on_a_peer_is_pulled_with_its_terms() -> None:
    q = query(256 * BS, {"a": 256}, {"a": 256})
    p = plan_prefix(q, WorkerView("b", transfer=COSTS), sources_of(q))
    assert (p.pull_blocks, p.source, p.recompute_tokens) == (256, "a", 0)
    assert p.pull_s == pytest.approx(COSTS.pull_rtt_s + 256 * (COSTS.block_pull_s + COSTS.block_load_s))
    assert 2 * p.pull_s < 256 * BS * COSTS.prefill_s_per_token


def test_only_the_blocks_the_worker_lacks_are_pulled_after_its_own_tier() -> None:
    q = query(256 * BS, {"a": 256, "b": 100}, {"a": 256, "b": 100})
    assert plan(q) == (100, 156, "a")


@pytest.mark.parametrize(
    "q",
    [
        query(256 * BS, {"a": 256}, {}),  # a serves no tier (or is out of rotation): not a source
        query(256 * BS, {"a": 256, "b": 256}, {"a": 256, "b": 256}),  # b holds it already
        query(256 * BS, {"a": 256}, {"a": 256}, margin=0.0),  # pulls off
    ],
)
def test_no_pull_without_a_better_source(q: RoutingQuery) -> None:
    assert plan(q)[1] == 0


def test_the_sources_are_the_pull_sources_when_given() -> None:
    q = query(64 * BS, {"a": 64, "c": 40, "b": 0}, {"c": 40})
    assert sources_of(q) == [("c", 40)]
    assert plan(q) == (0, 40, "c")
    assert sources_of(query(64 * BS, {"a": 64, "c": 40})) == [("a", 64), ("c", 40)]  # the simulator: everyone


def test_the_margin_decides() -> None:
    ratio = 64 * BS * COSTS.prefill_s_per_token / pull_seconds(64, COSTS)
    assert plan(query(64 * BS, {"a": 64}, {"a": 64}, margin=ratio * 0.99))[1] == 64
    assert plan(query(64 * BS, {"a": 64}, {"a": 64}, margin=ratio * 1.01))[1] == 0


def test_vllm_costs_scale_with_the_block_size() -> None:
    small, big = vllm_cpu_costs(16), vllm_cpu_costs(32)
    assert big.block_load_s == pytest.approx(2 * small.block_load_s)
    assert big.prefill_s_per_token == small.prefill_s_per_token and small.block_load_s < 16 * small.prefill_s_per_token


def test_costs_come_from_the_figures_alone() -> None:
    figures = TransferFigures(
        prefill_s_per_token=1e-4,
        kv_bytes_per_token=1000.0,
        host_to_gpu_bytes_per_s=1e6,
        network_bytes_per_s=1e5,
        network_rtt_s=0.5,
    )
    c = transfer_costs(BS, figures)
    assert (c.prefill_s_per_token, c.pull_rtt_s) == (1e-4, 0.5)
    assert (c.block_load_s, c.block_pull_s) == (BS * 1000.0 / 1e6, BS * 1000.0 / 1e5)


def test_the_default_figures_are_an_h200_node_serving_llama_70b_fp8() -> None:
    # the values the router priced with before its figures were its own (a routing decision must not move)
    assert DEFAULT_FIGURES.kv_bytes_per_token == 163_840.0
    assert COSTS.prefill_s_per_token == 2.0 * 70.6e9 / 989.5e12
    assert COSTS.block_load_s == 163_840.0 * BS / 50e9 and COSTS.block_pull_s == 163_840.0 * BS / 23.75e9
    assert COSTS.pull_rtt_s == 1e-3


def test_a_pending_pull_covers_its_prefix_until_it_expires() -> None:
    pending = PendingPulls(per_worker=2)
    hashes = [11, 12, 13, 14]
    pending.add("b", 12, PendingPull("a", 2, expires=10.0))
    pending.add("b", 14, PendingPull("a", 4, expires=5.0))
    assert pending.covering("b", hashes, 1.0) == PendingPull("a", 4, 5.0)  # the longest
    assert pending.covering("b", [11, 12, 99], 1.0) == PendingPull("a", 2, 10.0)  # another prompt, same prefix
    assert pending.covering("c", hashes, 1.0) is None and pending.covering("b", [99, 98], 1.0) is None
    assert pending.covering("b", hashes, 6.0) == PendingPull("a", 2, 10.0)  # the 4-block hint expired
    assert pending.covering("b", hashes, 10.0) is None
    for i in range(3):
        pending.add("b", 100 + i, PendingPull("a", 1, expires=99.0))
    assert pending.covering("b", [100], 0.0) is None and pending.covering("b", [102], 0.0) is not None  # bounded
