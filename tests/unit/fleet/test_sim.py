"""Fleet simulator: determinism under a seed, index consistency with the engines, perfect-knowledge hit ratio."""

from __future__ import annotations

import math
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest

from kvmesh.core.errors import InvalidArgument
from kvmesh.core.kvevents import BlockStored
from kvmesh.fleet.policies import make_policy
from kvmesh.fleet.readers import read_mooncake
from kvmesh.fleet.reference import pooled_lru_hit_ratio
from kvmesh.fleet.sim import FleetConfig, FleetSim, HashCache
from kvmesh.fleet.synthetic import multi_turn_sessions, shared_prefix_tenants
from kvmesh.index import PrefixIndex
from kvmesh.index.hashing import compute_block_hashes

pytestmark = pytest.mark.unit

MOONCAKE = Path(__file__).resolve().parents[4] / "shared" / "traces" / "mooncake_conversation_trace.jsonl"


@pytest.fixture(scope="module")
def small_trace():  # type: ignore[no-untyped-def]
    return read_mooncake(MOONCAKE, limit=400).window(0.0, 40.0)


def _fingerprint(sim_result):  # type: ignore[no-untyped-def]
    return [(r.index, r.worker, r.first_token, r.finish, r.cached_tokens) for r in sim_result.records]


@pytest.mark.parametrize("policy", ["kvmesh", "random", "dynamo", "sglang"])
def test_same_seed_same_run(small_trace, policy: str) -> None:  # type: ignore[no-untyped-def]
    cfg = FleetConfig(workers=4, load_scale=2.0, seed=7)
    a = FleetSim(small_trace, make_policy(policy), cfg).run()
    b = FleetSim(small_trace, make_policy(policy), cfg).run()
    assert len(a.records) == len(small_trace) > 50
    assert all(not math.isnan(r.finish) for r in a.records)
    assert _fingerprint(a) == _fingerprint(b)
    assert a.summary == b.summary


def test_another_seed_changes_a_random_policy(small_trace) -> None:  # type: ignore[no-untyped-def]
    cfg = FleetConfig(workers=4, load_scale=2.0, seed=7)
    a = FleetSim(small_trace, make_policy("random"), cfg).run()
    b = FleetSim(small_trace, make_policy("random"), replace(cfg, seed=8)).run()
    assert [r.worker for r in a.records] != [r.worker for r in b.records]


def test_index_mirrors_the_engines_and_uses_index_hashes(small_trace) -> None:  # type: ignore[no-untyped-def]
    cfg = FleetConfig(workers=3, load_scale=2.0, num_blocks=300)  # small pools: evictions happen
    sim = FleetSim(small_trace, make_policy("kvmesh"), cfg)
    sim.run()
    index = sim.index
    assert isinstance(index, PrefixIndex)
    assert sum(e.pool.evictions for e in sim.engines) > 0
    for wid, eng in zip(sim.ids, sim.engines, strict=True):
        held = {int(h) for h in index.blocks_of(wid)}
        assert held == eng.pool.cached_hashes()
        # the engine's hashes are the index hashes the cache-manager derives from token ids
        for ev in eng.pool.dump()[:20]:
            assert isinstance(ev, BlockStored)
            want = compute_block_hashes(np.asarray(ev.token_ids), cfg.block_size, parent=ev.parent_block_hash)
            assert [int(h) for h in want] == list(ev.block_hashes)


def test_perfect_knowledge_reaches_pooled_lru_hit_ratio() -> None:
    tr = shared_prefix_tenants(seed=1, n_tenants=6, sys_tokens=4096, rate=0.5, duration_s=240.0)
    cfg = FleetConfig(workers=4, block_size=64)
    sim = FleetSim(tr, make_policy("max_overlap"), cfg)
    cap = sum(e.pool.num_blocks for e in sim.engines)
    res = sim.run()
    hc = HashCache(tr, cfg.block_size)
    ref = pooled_lru_hit_ratio([(r.input_len, hc.hashes(r.index)) for r in tr], cfg.block_size, cap)
    assert ref > 0.5
    assert res.summary["hit_ratio"] == pytest.approx(ref, rel=0.02)
    rr = FleetSim(tr, make_policy("round_robin"), cfg).run()
    assert rr.summary["hit_ratio"] < res.summary["hit_ratio"] - 0.05


def test_closed_loop_follow_ups_arrive_after_completion() -> None:
    tr = multi_turn_sessions(seed=2, n_sessions=8, turns=(2, 3), first_tokens=(512, 2048))
    res = FleetSim(tr, make_policy("session"), FleetConfig(workers=2)).run()
    by = {r.index: r for r in res.records}
    assert len(by) == len(tr)
    for r in tr:
        if r.follows is not None:
            assert by[r.index].arrival == pytest.approx(by[r.follows].finish + r.think_s)
            assert by[r.index].worker == by[r.follows].worker  # affinity keeps the session's cache
            assert by[r.index].cached_tokens >= 512


def test_slo_stop_is_certain_and_cheaper(small_trace) -> None:  # type: ignore[no-untyped-def]
    cfg = FleetConfig(workers=2, load_scale=8.0)
    full = FleetSim(small_trace, make_policy("round_robin"), cfg).run()
    cut = FleetSim(small_trace, make_policy("round_robin"), replace(cfg, stop_when_slo_lost=True)).run()
    assert full.summary["meets_slo"] is False
    assert cut.stopped_early and cut.summary["meets_slo"] is False
    assert cut.events < full.events


def test_a_rejection_counts_against_the_accepted_requests(small_trace) -> None:  # type: ignore[no-untyped-def]
    """The fleet drives the engine's own admission: after one refusal its error rate is 1 / (accepted + 1),
    not 1.0 (a hand copy of `add_request` once dropped the accepted count)."""
    sim = FleetSim(small_trace, make_policy("kvmesh"), FleetConfig(workers=1))
    tokens = np.arange(8, dtype=np.int64)
    accepted = 0
    for _ in range(4096):
        if not sim.submit_warm(0, tokens):
            break
        accepted += 1
    else:
        pytest.fail("the engine never refused a request")
    report = sim.engines[0].load_report(sim.now)
    assert accepted > 1000
    assert report.errors_total == 1
    assert report.error_rate == pytest.approx(1 / (accepted + 1))
    assert sim.view(0).error_rate == pytest.approx(1 / (accepted + 1))


def test_the_fleet_still_refuses_out_of_range_tokens(small_trace) -> None:  # type: ignore[no-untyped-def]
    sim = FleetSim(small_trace, make_policy("kvmesh"), FleetConfig(workers=1))
    assert sim.engines[0].config.check_token_range is False  # checked once per prompt, vectorised
    with pytest.raises(InvalidArgument, match="token ids must be in"):
        sim.submit_warm(0, np.array([1, sim.cfg.vocab_size], dtype=np.int64))
