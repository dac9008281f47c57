"""Distinct prompts spread evenly over the router's workers: 64 random 512-token prompts (no shared blocks, so
no cache term steers them) over gRPC at concurrency 8 through a real router and two sim workers. The suite and
the traffic are those of `python -m kvmesh.bench balance`, which also runs them over two real vLLM workers and
reports the TTFT figures (docs/benchmarks.md: over vLLM the 60 % bound is not yet met in every run, so that
variant is a benchmark figure, not a CI test that would fail at random)."""

from __future__ import annotations

import pytest

from kvmesh.bench.balance import BalanceSetup, run_balance

pytestmark = pytest.mark.integration
MAX_SHARE = 0.60  # the bound issue 13 states: neither worker gets more than 60 % of the requests


def test_distinct_prompts_split_evenly_over_sim_workers() -> None:
    res = run_balance(BalanceSetup(engine="sim", workers=2, prompts=64, prompt_tokens=512, concurrency=8))
    assert sum(res["split"].values()) == 64
    assert len(res["split"]) == 2, res
    assert res["max_share"] <= MAX_SHARE, res
