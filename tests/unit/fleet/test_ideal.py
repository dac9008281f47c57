"""kvmesh.fleet.ideal: unservable requests and the idle, infinite-cache TTFT, against the simulator."""

from __future__ import annotations

from dataclasses import replace

import numpy as np
import pytest

from kvmesh.engine.sim.perf import H200_LLAMA70B_FP8, chunked_prefill_time
from kvmesh.fleet.evaluate import ideal_ttfts_of
from kvmesh.fleet.ideal import ideal_cached_tokens, ideal_ttft_s, servable_trace, unservable_reason
from kvmesh.fleet.metrics import RequestRecord, ttft_excess_ms
from kvmesh.fleet.policies import make_policy
from kvmesh.fleet.sim import FleetConfig, FleetSim, HashCache
from kvmesh.fleet.synthetic import multi_turn_sessions, shared_prefix_tenants
from kvmesh.fleet.trace import ChunkIds, Trace, TraceRequest

pytestmark = pytest.mark.unit

ENGINE = FleetConfig().engine_config()
CONTEXT = ENGINE.max_model_len


def _req(i: int, t: float, n_in: int, n_out: int, chunks: tuple[int, ...], follows: int | None = None) -> TraceRequest:
    return TraceRequest(i, t, n_in, n_out, chunks, follows=follows)


def test_unservable_reasons_follow_the_engines_limits() -> None:
    assert unservable_reason(CONTEXT - 100, 100, ENGINE) is None  # exactly the context: served
    assert unservable_reason(CONTEXT - 100, 101, ENGINE) == "context"
    assert unservable_reason(CONTEXT + 5, 1, ENGINE) == "context"
    assert unservable_reason(1000, ENGINE.max_tokens_limit + 1, ENGINE) == "max_tokens_limit"
    assert unservable_reason(0, 10, ENGINE) == "empty_prompt"
    small = replace(ENGINE, num_blocks=10)  # admits at most 9 blocks of 512: 4607 prompt tokens
    assert unservable_reason(9 * 512 - 1, 8, small) is None
    assert unservable_reason(9 * 512, 8, small) == "kv_pool"


def _overlong_trace() -> Trace:
    ids = ChunkIds(7)
    reqs = []
    for i in range(12):
        n = CONTEXT + 2048 if i in (3, 8) else 1024 + 256 * i
        reqs.append(_req(i, 0.5 * i, n, 16, ids.take(-(-n // 512))))
    return Trace("overlong", reqs)


def test_the_simulator_rejects_exactly_the_unservable_requests() -> None:
    """unservable_reason repeats the engine's KV rule by hand: the simulator must refuse the same requests."""
    tr = _overlong_trace()
    cfg = FleetConfig(workers=2, num_blocks=600)
    small = replace(cfg, num_blocks=4)  # the 1024+ token prompts need >= 3 blocks: most exceed 0.95 * 4
    for c in (cfg, small):
        want = {r.index for r in tr if unservable_reason(r.input_len, r.output_len, c.engine_config())}
        res = FleetSim(tr, make_policy("round_robin"), c).run()
        got = {r.index for r in res.records if np.isnan(r.first_token)}
        assert got == want and res.rejected == len(want) > 0
        kept, gone = servable_trace(tr, c.engine_config())
        assert len(kept) + len(gone.indices) == len(tr)
        assert FleetSim(kept, make_policy("round_robin"), c).run().rejected == 0
    assert servable_trace(tr, cfg.engine_config())[1].as_dict()["reasons"] == {"context": 2}


def test_servable_trace_reindexes_and_drops_follow_ups_of_removed_requests() -> None:
    reqs = [
        _req(0, 0.0, 600, 4, (1, 2)),
        _req(1, 1.0, CONTEXT + 1, 4, tuple(range(100, 358))),
        _req(2, 0.0, 700, 4, (1, 3), follows=1),  # waits on the removed one: dropped
        _req(3, 0.0, 800, 4, (1, 4), follows=2),  # and so does its own follow-up
        _req(4, 2.0, 900, 4, (5, 6)),
        _req(5, 0.0, 900, 4, (5, 7), follows=4),
    ]
    kept, gone = servable_trace(Trace("t", reqs), ENGINE)
    assert [r.index for r in kept] == [0, 1, 2]
    assert [r.input_len for r in kept] == [600, 900, 900]
    assert kept.requests[2].follows == 1  # request 5 followed 4, now re-indexed 1
    assert gone.as_dict() == {
        "count": 1,
        "of_requests": 6,
        "reasons": {"context": 1},
        "dropped_followups": 2,
        "indices": [1],
    }
    same, none = servable_trace(kept, ENGINE)
    assert same is kept and none.as_dict()["count"] == 0


def test_ideal_cached_tokens_is_the_longest_prefix_seen_before() -> None:
    h = np.array
    prompts = [(40, h([1, 2])), (40, h([1, 2])), (48, h([1, 9, 4])), (33, h([1, 2])), (16, h([1])), (17, h([1]))]
    # block 16: nothing seen; [1,2] seen (32); only [1] (16); 33 tokens: 2 full blocks, both seen (32);
    # 16 tokens = one full block, but the last token is always computed: 0; 17 tokens: 16
    assert ideal_cached_tokens(prompts, 16) == [0, 32, 16, 32, 0, 16]


def test_ideal_ttft_is_the_simulated_ttft_of_a_lone_request() -> None:
    """On an idle fleet whose requests never overlap, TTFT equals the ideal exactly: the excess is 0."""
    ids = ChunkIds(9)
    system = ids.take(8)  # a shared 4096-token prefix
    reqs = [
        _req(i, 60.0 * i, 4096 + 700 * (i + 1), 4, system + ids.take(1 + (700 * (i + 1)) // 512 + 1)) for i in range(4)
    ]
    tr = Trace("lone", reqs)
    cfg = FleetConfig(workers=1)
    res = FleetSim(tr, make_policy("round_robin"), cfg).run()
    ideal = ideal_ttfts_of(tr, HashCache(tr, cfg.block_size), cfg)
    assert ideal[0] == pytest.approx(chunked_prefill_time(reqs[0].input_len, 0, cfg.prefill_chunk_tokens))
    assert ideal[1] == pytest.approx(ideal_ttft_s(reqs[1].input_len, 4096, 1024, H200_LLAMA70B_FP8))
    for r in res.records:
        assert r.cached_tokens == (0 if r.index == 0 else 4096)
        assert r.ttft == pytest.approx(ideal[r.index], rel=1e-12)
    assert ttft_excess_ms(res.records, ideal)["p99"] == pytest.approx(0.0, abs=1e-6)


@pytest.mark.parametrize("policy", ["round_robin", "kvmesh", "random"])
def test_ttft_excess_is_never_negative_under_load(policy: str) -> None:
    """The ideal is a lower bound for any policy: queueing, batching and lost cache only add (raw values)."""
    tr = shared_prefix_tenants(seed=3, n_tenants=5, sys_tokens=4096, rate=2.0, duration_s=60.0)
    cfg = FleetConfig(workers=3, load_scale=2.0, num_blocks=200)  # small pools: evictions lose cache
    res = FleetSim(tr, make_policy(policy), cfg).run()
    ideal = ideal_ttfts_of(tr, HashCache(tr, cfg.block_size), cfg)
    raw = np.array([r.ttft - ideal[r.index] for r in res.records if not np.isnan(r.first_token)])
    assert raw.size == len(tr) and raw.min() >= -1e-9
    assert raw.max() > 0.05  # the load is real: somebody queued
    ex = ttft_excess_ms(res.records, ideal)
    assert (
        0.0
        <= ex["p50"]
        <= ex["p90"]
        <= ex["p99"]
        == pytest.approx(1000 * np.sort(raw)[int(np.ceil(0.99 * raw.size)) - 1])
    )


def test_ideal_of_closed_loop_follow_ups_counts_the_conversation_so_far() -> None:
    tr = multi_turn_sessions(seed=2, n_sessions=4, turns=(2, 3), first_tokens=(1024, 2048))
    hc = HashCache(tr, 512)
    cached = ideal_cached_tokens(((r.input_len, hc.hashes(r.index)) for r in tr), 512)
    for r in tr:
        if r.follows is not None:
            prev = tr.requests[r.follows]
            assert cached[r.index] >= (prev.input_len // 512) * 512  # the earlier turn is a prefix


def test_ttft_excess_skips_requests_without_a_first_token() -> None:
    recs = [RequestRecord(i, "w", 0.0, 100, 2, first_token=1.0 + i, finish=2.0 + i) for i in range(3)]
    recs.append(RequestRecord(3, "w", 0.0, 100, 2))  # rejected
    ex = ttft_excess_ms(recs, [0.5, 0.5, 0.5, 0.5])
    assert ex == {"p50": pytest.approx(1500.0), "p90": pytest.approx(2500.0), "p99": pytest.approx(2500.0)}
