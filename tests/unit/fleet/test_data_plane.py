"""Fleet KV data plane: tiers (LFU+LRU), pull pricing with its margin, in-flight pull dedup, tier loads in the
simulator, the pooled-LRU reference of the same capacity, and a tiny ``bench fleet --data-plane`` run."""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import replace
from pathlib import Path

import pytest

from kvmesh.bench import fleet as bench_fleet
from kvmesh.engine.sim.perf import H200_LLAMA70B_FP8, block_bytes, tier_blocks
from kvmesh.fleet.policies.base import Policy
from kvmesh.fleet.readers import read_mooncake, write_mooncake
from kvmesh.fleet.reference import pooled_lru_hit_ratio
from kvmesh.fleet.sim import FleetConfig, FleetSim, HashCache
from kvmesh.fleet.tiers import DataPlane, KvTier, TierSpec, WorkerTiers
from kvmesh.fleet.trace import Trace, TraceRequest
from kvmesh.routing.dataplane import plan_prefix, pull_pays, top_sources
from kvmesh.routing.scorers.cost import CostScorer
from kvmesh.routing.types import RoutingQuery, TransferCosts, WorkerView

pytestmark = pytest.mark.unit

MOONCAKE = Path(__file__).resolve().parents[4] / "shared" / "traces" / "mooncake_conversation_trace.jsonl"
BS = 512


# ---------------------------------------------------------------- tier model
def test_tier_keeps_the_frequently_used_block_over_a_newer_one() -> None:
    t = KvTier(2, half_life_s=100.0)
    t.save(1, 0.0)
    t.touch(1, 1.0)
    t.touch(1, 2.0)  # block 1: three accesses, score ≈ 3
    t.save(2, 3.0)  # block 2: one access, newer
    assert t.save(3, 4.0) == [2]  # LFU side: the newer single-use block goes, not the older hot one
    assert 1 in t and 3 in t and len(t) == 2


def test_tier_forgets_old_frequency_recency_wins_after_many_half_lives() -> None:
    t = KvTier(2, half_life_s=1.0)
    t.save(1, 0.0)
    for k in range(1, 5):
        t.touch(1, float(k))  # hot at t ≤ 4
    t.save(2, 50.0)
    assert t.save(3, 51.0) == [1]  # 47 half-lives later block 1's score ≈ 0: LRU side


def test_tier_capacity_is_a_bound_and_stale_heap_entries_stay_bounded() -> None:
    t = KvTier(5)
    for k in range(200):
        t.save(k % 9, float(k))
        assert len(t) <= 5
    assert len(t._heap) <= 4 * len(t) + 64 + 1


def test_worker_tiers_spill_cpu_to_disk_then_drop() -> None:
    wt = WorkerTiers(TierSpec(cpu_blocks=2, disk_blocks=1))
    assert wt.save_evicted([1, 2], 0.0) == []
    assert wt.medium(1) == "cpu"
    assert wt.save_evicted([3], 1.0) == []  # CPU full: its lowest block goes to disk
    assert wt.medium(1) == "disk" and wt.medium(3) == "cpu"
    gone = wt.save_evicted([4], 2.0)  # CPU evicts 2 to disk, disk evicts 1: it leaves the worker
    assert gone == [1] and 1 not in wt and wt.medium(2) == "disk"
    assert wt.dropped == 1


def test_tier_blocks_and_block_bytes_come_from_the_perf_model() -> None:
    assert block_bytes(BS) == H200_LLAMA70B_FP8.kv_bytes_per_token * BS == 163_840 * 512
    assert tier_blocks(256, BS) == int(256e9 // (163_840 * 512)) == 3051
    cfg = FleetConfig(workers=16, data_plane=DataPlane(256.0))
    assert cfg.fleet_capacity_blocks() == 16 * (H200_LLAMA70B_FP8.kv_capacity_blocks(BS) + 3051)
    assert FleetConfig(workers=16).fleet_capacity_blocks() == 16 * H200_LLAMA70B_FP8.kv_capacity_blocks(BS)


# ---------------------------------------------------------------- pull pricing
# prefill of one 512-token block: 512 · 1e-4 = 51.2 ms
COSTS = TransferCosts(prefill_s_per_token=1e-4, block_load_s=0.002, block_pull_s=0.01, pull_rtt_s=0.001)


def _query(tier: dict[str, int], gpu: dict[str, int] | None = None, pulls: bool = True) -> RoutingQuery:
    return RoutingQuery("r", 8 * BS + 10, list(range(8)), gpu or {}, BS, tier_matches=tier, peer_pulls=pulls)


def test_pull_is_chosen_only_when_it_beats_recompute_with_the_margin() -> None:
    recompute = 4 * BS * COSTS.prefill_s_per_token  # 0.2048 s for 4 blocks
    per = COSTS.block_load_s  # a pulled block also crosses PCIe
    slow = replace(COSTS, block_pull_s=(recompute / 1.5 - COSTS.pull_rtt_s) / 4 - per)  # pull = recompute / 1.5
    fast = replace(COSTS, block_pull_s=(recompute / 2.5 - COSTS.pull_rtt_s) / 4 - per)  # pull = recompute / 2.5
    assert not pull_pays(4, BS, slow, margin=2.0)  # faster than recomputing, but not by the margin
    assert pull_pays(4, BS, slow, margin=1.0)
    assert pull_pays(4, BS, fast, margin=2.0)
    q = _query({"a": 4})
    plan = plan_prefix(q, WorkerView("b", transfer=slow), top_sources(q.tier_matches), margin=2.0)
    assert plan.pull_blocks == 0 and plan.recompute_tokens == q.prompt_tokens
    plan = plan_prefix(q, WorkerView("b", transfer=fast), top_sources(q.tier_matches), margin=2.0)
    assert (plan.pull_blocks, plan.source) == (4, "a")
    assert plan.recompute_tokens == q.prompt_tokens - 4 * BS
    assert plan.pull_s == pytest.approx(recompute / 2.5)


def test_plan_prices_gpu_tier_pull_and_recompute_in_seconds() -> None:
    q = _query({"w": 3, "p": 6}, gpu={"w": 1})
    plan = plan_prefix(q, WorkerView("w", transfer=COSTS), top_sources(q.tier_matches))
    assert (plan.gpu_blocks, plan.load_blocks, plan.pull_blocks, plan.source) == (1, 2, 3, "p")
    assert plan.load_s == pytest.approx(2 * 0.002)
    assert plan.pull_s == pytest.approx(0.001 + 3 * (0.01 + 0.002))
    assert plan.recompute_tokens == 8 * BS + 10 - 6 * BS
    assert plan.time_s == pytest.approx(plan.load_s + plan.pull_s + plan.recompute_tokens * 1e-4)
    assert plan.prefill_tokens(COSTS) == pytest.approx(plan.time_s / 1e-4)
    # the source itself never pulls from itself; without peer pulls only GPU + own tier count
    own = plan_prefix(q, WorkerView("p", transfer=COSTS), top_sources(q.tier_matches))
    assert own.pull_blocks == 0 and own.load_blocks == 6
    nopull = plan_prefix(_query({"w": 3, "p": 6}, {"w": 1}, pulls=False), WorkerView("w", transfer=COSTS), [("p", 6)])
    assert nopull.pull_blocks == 0 and nopull.covered_blocks == 3


def test_cost_scorer_prices_tiers_and_pulls_and_is_unchanged_without_a_data_plane() -> None:
    scorer = CostScorer(prefill_weight=0.9, decode_weight=0.1, prefill_slots=8)
    plain = [WorkerView("a", prefill_tokens_queued=3000), WorkerView("b")]
    q0 = RoutingQuery("r", 8 * BS + 10, list(range(8)), {"a": 6}, BS)
    base = scorer.score(q0, plain, plain)
    # no transfer costs: the tier matches are ignored, the cost is the GPU-only one
    q1 = replace(q0, tier_matches={"a": 8, "b": 8}, peer_pulls=True)
    assert scorer.score(q1, plain, plain) == base
    dp = [replace(w, transfer=COSTS) for w in plain]
    assert scorer.score(q0, dp, dp) == base  # no tier matches: unchanged too
    # b holds nothing anywhere; with peer pulls it gets a's prefix for a few ms instead of ~0.3 s of prefill
    q2 = replace(q0, tier_matches={"a": 6}, peer_pulls=True)
    pulled = scorer.score(q2, dp, dp)
    q3 = replace(q2, peer_pulls=False)
    assert pulled[1] < scorer.score(q3, dp, dp)[1]


# ---------------------------------------------------------------- simulator: pulls, dedup, tier loads
class Scripted(Policy):
    """Routes request i to ``plan[i]``."""

    name = "scripted"

    def __init__(self, plan: Sequence[str], peer_pulls: bool) -> None:
        self.plan = list(plan)
        self.peer_pulls = peer_pulls

    def choose(self, req: RoutingQuery, workers: Sequence[WorkerView], now: float) -> str:
        return self.plan[int(req.request_id)]


def _req(i: int, t: float, chunks: Sequence[int], tail: int = 100) -> TraceRequest:
    return TraceRequest(i, t, len(chunks) * BS + tail, 4, (*chunks, 10_000 + i))


def test_two_requests_for_one_prefix_on_one_worker_pull_it_once() -> None:
    prefix = list(range(1, 9))
    tr = Trace("t", [_req(0, 0.0, prefix), _req(1, 100.0, prefix), _req(2, 100.0, prefix)])
    cfg = FleetConfig(workers=2, data_plane=DataPlane(1.0))
    sim = FleetSim(tr, Scripted(["w00", "w01", "w01"], peer_pulls=True), cfg)
    res = sim.run()
    st = res.summary["data_plane"]
    assert (st["pulls"], st["pulled_blocks"], st["deduped_blocks"]) == (1, 8, 8)
    assert st["pull_bytes"] == 8 * block_bytes(BS)
    r1, r2 = res.records[1], res.records[2]
    assert r1.cached_tokens == r2.cached_tokens == 8 * BS
    costs = cfg.data_plane.transfer_costs(BS)  # type: ignore[union-attr]
    assert r1.first_token >= 100.0 + costs.pull_rtt_s + 8 * (costs.block_pull_s + costs.block_load_s)
    # without peer pulls (another policy given the same tier) the prefix is recomputed (request 2 reuses
    # only what request 1's first chunks computed before it was admitted)
    res = FleetSim(tr, Scripted(["w00", "w01", "w01"], peer_pulls=False), cfg).run()
    assert res.summary["data_plane"]["pulled_blocks"] == 0
    assert res.records[1].cached_tokens == 0 and res.records[2].cached_tokens < 8 * BS


def test_a_pull_that_does_not_pay_by_the_margin_is_not_made() -> None:
    prefix = list(range(1, 9))
    tr = Trace("t", [_req(0, 0.0, prefix), _req(1, 100.0, prefix)])
    slow_net = DataPlane(1.0, pull_margin=1e6)
    res = FleetSim(tr, Scripted(["w00", "w01"], True), FleetConfig(workers=2, data_plane=slow_net)).run()
    assert res.summary["data_plane"]["pulls"] == 0 and res.summary["data_plane"]["pulls_refused"] == 1
    assert res.records[1].cached_tokens == 0


def test_blocks_the_gpu_evicts_are_loaded_back_from_the_cpu_tier() -> None:
    first = list(range(1, 9))
    tr = Trace(
        "t",
        [
            _req(0, 0.0, first),
            _req(1, 50.0, list(range(100, 111))),
            _req(2, 75.0, list(range(200, 211))),
            _req(3, 100.0, first),
        ],
    )
    pol = ["w00"] * 4
    cfg = FleetConfig(workers=1, num_blocks=13)  # requests 1 and 2 need 12 blocks each: request 0's prefix goes
    res = FleetSim(tr, Scripted(pol, False), cfg).run()
    left_on_gpu = res.records[3].cached_tokens // BS
    assert left_on_gpu < 8
    res = FleetSim(tr, Scripted(pol, False), replace(cfg, data_plane=DataPlane(2.0))).run()  # 23 blocks
    st = res.summary["data_plane"]
    assert st["loaded_cpu_blocks"] == 8 - left_on_gpu and st["pulled_blocks"] == 0
    assert res.records[3].cached_tokens == 8 * BS
    # with a zero CPU tier nothing is kept
    res = FleetSim(tr, Scripted(pol, False), replace(cfg, data_plane=DataPlane(0.0))).run()
    assert res.records[3].cached_tokens == left_on_gpu * BS


# ---------------------------------------------------------------- references and the bench
@pytest.fixture(scope="module")
def small_trace() -> Trace:
    return read_mooncake(MOONCAKE, limit=300).window(0.0, 30.0)


def test_pooled_lru_of_the_same_capacity_is_one_lru_over_gpu_plus_tiers(tmp_path: Path, small_trace: Trace) -> None:
    gpu_only = FleetConfig(workers=2, num_blocks=40)
    tiered = replace(gpu_only, data_plane=DataPlane(1.0))  # 11 CPU blocks per worker
    assert tiered.fleet_capacity_blocks() == 2 * (40 + 11)
    hc = HashCache(small_trace, BS)
    prompts = [(r.input_len, hc.hashes(r.index)) for r in small_trace]
    same = bench_fleet.same_capacity_ratio(_write(small_trace, tmp_path / "t.jsonl"), tiered)
    assert same == pooled_lru_hit_ratio(prompts, BS, 102)
    assert same > pooled_lru_hit_ratio(prompts, BS, 80)


def _write(trace: Trace, path: Path) -> str:
    """The trace as a Mooncake .jsonl at ``path`` (the bench reads paths)."""
    write_mooncake(trace, path)
    return str(path)


def test_bench_fleet_with_the_data_plane_writes_its_keys(tmp_path: Path, small_trace: Trace) -> None:
    short = [r for r in small_trace if r.input_len < 8000][:40]  # no prompt whose prefill alone breaks the SLO
    path = _write(Trace("short", [replace(r, index=i) for i, r in enumerate(short)]), tmp_path / "t.jsonl")
    args = ["--trace", path, "--workers", "2", "--policies", "kvmesh,dynamo", "--out", str(tmp_path), "--jobs", "1"]
    args += ["--bisect-window-s", "0", "--skip-studies", "--data-plane", "--cpu-tier-gb", "1"]
    args += ["--tier-sweep-gb", "0,1"]
    assert bench_fleet.main(args) == 0
    res = json.loads((tmp_path / "results.json").read_text())
    assert 0 < res["pooled_lru_same_capacity_hit_ratio"] <= 1
    assert res["data_plane"]["cpu_tier_blocks_per_worker"] == 11
    assert res["kvmesh"]["data_plane"]["peer_pulls"] is True
    assert res["dynamo"]["data_plane"]["peer_pulls"] is False
    assert res["dynamo"]["data_plane"]["pulled_blocks"] == 0
    assert set(res["kvmesh_data_plane_off"]) >= {"slo_capacity", "hit_ratio"}
    assert [t["cpu_tier_gb"] for t in res["tier_sweep"]] == [0.0, 1.0]
    md = (tmp_path / "report.md").read_text()
    assert "## Data plane" in md
    assert f"Reproduce: `python -m kvmesh.bench fleet {' '.join(args)}`" in md  # its own flags, data plane's too
    assert "Wall time of the whole run:" in md
