"""Prefill/decode disaggregation in the fleet simulator: the pools, the handoff's timing, each peer decider's
rule, and the searches (best split, best step budget)."""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import replace

import pytest

from kvmesh.core.handoff import WorkerRole
from kvmesh.engine.sim.perf import H200_LLAMA70B_FP8
from kvmesh.fleet.capacity import bisect_capacity
from kvmesh.fleet.pd import PdFleet, make_decider
from kvmesh.fleet.pd_eval import chunk_configs, default_splits, search_best, split_configs
from kvmesh.fleet.policies import make_policy
from kvmesh.fleet.policies.base import Policy
from kvmesh.fleet.sim import FleetConfig, FleetSim
from kvmesh.fleet.trace import Trace, TraceRequest
from kvmesh.routing.types import RoutingQuery, WorkerView

pytestmark = pytest.mark.unit

BS = 512
KV_TOK = H200_LLAMA70B_FP8.kv_bytes_per_token


def _req(i: int, t: float, blocks: int, tail: int = 100, out: int = 4) -> TraceRequest:
    return TraceRequest(i, t, blocks * BS + tail, out, tuple(1000 * (i + 1) + k for k in range(blocks + 1)))


def _one(link_gbps: float) -> tuple[FleetSim, float]:
    tr = Trace("t", [_req(0, 0.0, 8)])
    sim = FleetSim(tr, make_policy("kvmesh"), FleetConfig(workers=2, pd=PdFleet(1, "always", link_gbps)))
    res = sim.run()
    return sim, res.records[0].first_token


def test_prefill_engine_never_decodes_and_the_decode_engine_gets_the_kv_after_the_handoff() -> None:
    sim, first_100 = _one(100.0)
    prompt = 8 * BS + 100
    pre, dec = sim.engines
    assert sim.roles == [WorkerRole.PREFILL, WorkerRole.DECODE]
    assert pre.decode_tokens_total == 0 and pre.prefill_tokens_total == prompt
    # the decode half computes only the prompt's last token, then decodes the other 3
    assert dec.prefill_tokens_total == 1 and dec.decode_tokens_total == 3
    pd = sim.pd_summary()
    assert (pd["split"], pd["disagg_share"], pd["fallbacks"]) == ("1P1D", 1.0, 0)
    handoff = 1e-3 + KV_TOK * (prompt - 1) / (100e9 / 8)  # rtt + bytes / link
    assert pd["handoff_ms"]["p50"] == pytest.approx(1000 * handoff)
    # a 4x faster NIC moves the first token earlier by exactly the bytes' time saved
    _, first_400 = _one(400.0)
    saved = KV_TOK * (prompt - 1) * (1 / (100e9 / 8) - 1 / (400e9 / 8))
    assert first_100 - first_400 == pytest.approx(saved, rel=1e-9)


def test_the_decode_worker_is_sent_only_the_blocks_it_lacks() -> None:
    # request 1 shares request 0's 8 blocks; request 0 left them on the decode worker
    tr = Trace("t", [_req(0, 0.0, 8), TraceRequest(1, 100.0, 8 * BS + 300, 4, (*_req(0, 0, 8).chunks[:8], 77, 78))])
    sim = FleetSim(tr, make_policy("kvmesh"), FleetConfig(workers=2, pd=PdFleet(1, "always")))
    res = sim.run()
    assert all(not math.isnan(r.finish) for r in res.records)
    ho = sorted(sim._handoff_s)
    assert ho[0] == pytest.approx(1e-3 + KV_TOK * 299 / (100e9 / 8))  # 8 blocks held: only the last 299 tokens
    assert res.records[1].cached_tokens == 8 * BS  # the hit is the prefill worker's


def test_no_prefill_pool_is_the_aggregated_fleet() -> None:
    tr = Trace("t", [_req(i, 0.5 * i, 4 + i % 5, out=20) for i in range(30)])
    cfg = FleetConfig(workers=3, load_scale=4.0)
    agg = FleetSim(tr, make_policy("kvmesh"), cfg).run()
    pd = FleetSim(tr, make_policy("kvmesh"), replace(cfg, pd=PdFleet(0, "kvmesh"))).run()
    fp = [(r.worker, r.first_token, r.finish, r.cached_tokens) for r in agg.records]
    assert fp == [(r.worker, r.first_token, r.finish, r.cached_tokens) for r in pd.records]
    assert pd.summary["pd"]["disagg_share"] == 0.0 and pd.summary["pd"]["split"] == "0P3D"


class First(Policy):
    """Routes to the first worker offered."""

    def choose(self, req: RoutingQuery, workers: Sequence[WorkerView], now: float) -> str:
        return workers[0].id


def _views(prefill_waiting: int = 0) -> list[WorkerView]:
    return [
        WorkerView(id="p0", role=WorkerRole.PREFILL, waiting=prefill_waiting),
        WorkerView(id="d0", role=WorkerRole.DECODE),
        WorkerView(id="d1", role=WorkerRole.DECODE),
    ]


def _uncached(n: int, cached_blocks: int = 4) -> RoutingQuery:
    """A query with n tokens uncached on d0 (the decode worker `First` routes to)."""
    prompt = cached_blocks * BS + n
    return RoutingQuery("r", prompt, tuple(range(prompt // BS)), {"d0": cached_blocks, "p0": 0}, BS)


@pytest.mark.parametrize(
    ("decider", "below", "at_or_above"),
    [("dynamo", 1000, 1001), ("llm_d", 15, 16), ("vllm_router", 255, 256)],
)
def test_peer_deciders_disaggregate_from_their_threshold_of_uncached_tokens_on_the_decode_worker(
    decider: str, below: int, at_or_above: int
) -> None:
    d = make_decider(decider)
    low = d.choose(_uncached(below), _views(), First(), 0.0)
    assert not low.disaggregate and low.decode == "d0" and low.reason == "short-prefill"
    high = d.choose(_uncached(at_or_above), _views(), First(), 0.0)
    assert high.disaggregate and (high.prefill, high.decode) == ("p0", "d0")
    # what the prefill worker caches does not count: only the decode worker's prefix hit
    assert not d.choose(replace(_uncached(below), matches={"d0": 4, "p0": 99}), _views(), First(), 0.0).disaggregate


def test_dynamo_prefills_locally_when_its_prefill_queue_is_full() -> None:
    d = make_decider("dynamo")
    assert d.choose(_uncached(5000), _views(prefill_waiting=1), First(), 0.0).disaggregate
    full = d.choose(_uncached(5000), _views(prefill_waiting=2), First(), 0.0)
    assert not full.disaggregate and full.fallback and full.reason == "prefill-busy"


def test_always_disaggregates_even_a_one_token_prompt() -> None:
    q = RoutingQuery("r", 1, (), {}, BS)
    assert make_decider("always").choose(q, _views(), make_policy("kvmesh"), 0.0).disaggregate
    assert not make_decider("kvmesh").choose(q, _views(), make_policy("kvmesh"), 0.0).disaggregate


def test_search_best_finds_the_best_candidate_and_gates_the_others_with_one_probe() -> None:
    caps = {"a": 1.0, "b": 0.8, "c": 2.0, "d": 1.5, "e": 0.0}
    calls: list[tuple[str, float]] = []

    def meets(c: str, s: float) -> bool:
        calls.append((c, s))
        return s <= caps[c]

    got = search_best(list(caps), meets)
    assert got.best == 2
    alone = bisect_capacity(lambda s: s <= 2.0, start=0.5).value
    assert 2.0 / 1.05 <= got.capacity <= 2.0 and got.capacity >= alone / 1.05
    by = {s.candidate: s for s in got.searched}
    assert by["b"].capacity is None and len(by["b"].probes) == 1  # below the best: one probe
    assert by["d"].capacity is None and len(by["d"].probes) == 1
    assert by["a"].capacity is not None and by["a"].capacity <= 1.0
    assert len(calls) == len(set(calls))  # memoised: no probe twice
    # nothing meets the SLO: no best, capacity 0
    none = search_best(["x"], lambda c, s: False)
    assert (none.best, none.capacity) == (None, 0.0)


def test_split_and_budget_candidates() -> None:
    assert default_splits(16) == [4, 8, 12, 0]  # 0 (no prefill pool) last
    assert default_splits(4) == [1, 2, 3, 0]
    base = FleetConfig(workers=16)
    cfgs = split_configs(base, "llm_d", [0, 12], 400.0)
    assert [c.pd.split(16) for c in cfgs if c.pd] == ["0P16D", "12P4D"]
    assert all(c.pd is not None and c.pd.link_gbps == 400.0 and c.allowance_chunk_tokens == 1024 for c in cfgs)
    budgets = chunk_configs(base, [(8192, 1024), (512, 512)])
    assert [(c.max_batched_tokens, c.prefill_chunk_tokens, c.allowance_chunk_tokens) for c in budgets] == [
        (8192, 1024, 1024),
        (512, 512, 1024),
    ]
    with pytest.raises(ValueError, match="prefill_workers"):
        FleetSim(Trace("t", []), make_policy("kvmesh"), FleetConfig(workers=2, pd=PdFleet(2)))
