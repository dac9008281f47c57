"""`kvmesh.bench pd` helpers: the counts come from what the measured load added to the services' /metrics (the
warm-up's are not counted), a fallback is no handoff, ITL is the streams' only, and the warm-up shares no
block with the measured prompts."""

from __future__ import annotations

import pytest

from kvmesh.bench.pd import BLOCK_SIZE, PdSetup, Result, Samples, handoff_counts, load, main, summary, warm_up_load

pytestmark = pytest.mark.unit


def _router(agg: float, dis: float, no_handoff: float, blocks: float) -> Samples:
    return {
        "kvmesh_pd_decisions_total": [
            ({"mode": "aggregated", "reason": "short-prefill"}, agg),
            ({"mode": "disaggregated", "reason": "disaggregate"}, dis),
        ],
        "kvmesh_handoff_fallbacks_total": [({"cause": "no_handoff"}, no_handoff)],
        "kvmesh_handoff_blocks_total": [({}, blocks)],
    }


def test_counts_are_the_measured_loads_growth_and_fallbacks_are_not_handoffs() -> None:
    router = (_router(2, 3, 0, 141), _router(6, 9, 1, 376))  # the warm-up's 2 + 3 decisions come before
    holds = [({"outcome": "collected"}, 5.0), ({"outcome": "expired"}, 0.0)]
    prefill: tuple[Samples, Samples] = ({}, {"kvmesh_worker_handoffs_total": holds})
    decode = (
        {"kvmesh_worker_engine_handoffs": [({"event": "received"}, 3.0)]},
        {"kvmesh_worker_engine_handoffs": [({"event": "received"}, 7.0), ({"event": "sent"}, 0.0)]},
    )
    got = handoff_counts(router, prefill, decode)
    assert got["pd_decisions"] == {"aggregated/short-prefill": 4, "disaggregated/disaggregate": 6}
    assert got["handoffs"] == 5 and got["fallbacks"] == 1 and got["fallback_causes"] == {"no_handoff": 1}
    assert got["handoff_blocks"] == 235
    assert got["kv_sync"] == {"collected": 5} and got["nixl"] == {"received": 4}


def test_itl_is_the_streams_gaps_ttft_every_answered_requests_and_failures_are_counted() -> None:
    results = {
        "s0": Result(True, [1, 2, 3], ttft_ms=10.0, gaps_ms=[5.0, 7.0]),
        "l0": Result(False, [4], ttft_ms=900.0, gaps_ms=[500.0], migrations=1),
        "l1": Result(False, [], error="UNAVAILABLE"),  # refused by the router: no token, no TTFT of 0
    }
    got = summary(results)
    assert got["itl_ms"] == {"p50": 7.0, "p99": 7.0}  # the long prompt's 500 ms gap is not a stream's
    assert got["ttft_ms"] == {"p50": 900.0, "p99": 900.0} and got["migrated"] == 1
    assert got["failed"] == {"UNAVAILABLE": 1}


def test_the_warm_up_shares_no_block_with_the_measured_prompts() -> None:
    jobs = load(PdSetup())
    firsts = {j.prompt[:BLOCK_SIZE] for j in jobs}
    warm = warm_up_load(jobs)
    assert warm and all(w.prompt[:BLOCK_SIZE] not in firsts for w in warm)
    assert {j.stream for j in warm} == {True, False}  # both kinds warmed: the decode path and the handoff


def test_a_bad_flag_is_refused_by_name(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exc:
        main(["--engine", "sim", "--long-tokens", "0"])
    assert exc.value.code == 2 and "--long-tokens must be at least 1" in capsys.readouterr().err
