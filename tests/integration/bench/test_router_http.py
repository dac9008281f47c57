"""`python -m kvmesh.bench router --api http` (kvmesh with its cache-manager against direct): one JSON line with
latency, throughput and the router's CPU time per request; a bad --distinct-prompts is refused by name."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

pytestmark = pytest.mark.integration

BENCH = [sys.executable, "-m", "kvmesh.bench", "router", "--api", "http", "--workers", "2"]


def test_http_bench_reports_figures_for_kvmesh_and_direct() -> None:
    args = ["--prompt-tokens", "128", "--requests", "40", "--c1-requests", "8", "--concurrency", "4"]
    out = subprocess.run(
        [*BENCH, *args, "--distinct-prompts", "4"], capture_output=True, text=True, timeout=180, check=True
    )
    lines = [ln for ln in out.stdout.splitlines() if ln.strip()]
    assert len(lines) == 1, out.stdout
    res = json.loads(lines[0])
    assert res["distinct_prompts"] == 4 and res["requests"] == 40 and res["concurrency"] == 4
    assert res["worker_transport"] == "stream"  # the default path: router → worker on gRPC
    for path in ("direct", "kvmesh"):
        fig = res[path]["128"]
        assert 0 < fig["c1_p50_ms"] <= fig["c1_p99_ms"] and fig["c4_rps"] > 0
        assert fig["host_cpu_us_per_request"] > 0  # the client and the workers at least were busy
    # the router and its cache-manager did work for every request: a CPU figure, never zero
    assert res["kvmesh"]["128"]["cpu_us_per_request"] > 0
    assert "cpu_us_per_request" not in res["direct"]["128"]  # the client's own workers are not a router
    assert 100 < res["prompt_tokens"]["128"] < 160


def test_two_client_processes_send_the_concurrency_runs_and_every_request_is_counted() -> None:
    # the bench refuses a run whose client processes sent other than the requests asked for (check=True)
    args = ["--prompt-tokens", "64", "--requests", "30", "--c1-requests", "4", "--concurrency", "3"]
    out = subprocess.run(
        [*BENCH, *args, "--distinct-prompts", "2", "--client-processes", "2"],
        capture_output=True,
        text=True,
        timeout=180,
        check=True,
    )
    res = json.loads(out.stdout.strip().splitlines()[-1])
    assert res["client_processes"] == 2
    for path in ("direct", "kvmesh"):
        assert res[path]["64"]["c3_rps"] > 0
    assert res["kvmesh"]["64"]["cpu_us_per_request"] > 0


def test_client_processes_are_refused_over_grpc_and_below_one() -> None:
    grpc_bench = [sys.executable, "-m", "kvmesh.bench", "router", "--workers", "2", "--client-processes", "2"]
    out = subprocess.run(grpc_bench, capture_output=True, text=True, timeout=60)
    assert out.returncode == 2 and "--client-processes applies to --api http only" in out.stderr
    out = subprocess.run([*BENCH, "--client-processes", "0"], capture_output=True, text=True, timeout=60)
    assert out.returncode == 2 and "--client-processes must be >= 1, got 0" in out.stderr


def test_distinct_prompts_below_one_is_refused() -> None:
    out = subprocess.run([*BENCH, "--distinct-prompts", "0"], capture_output=True, text=True, timeout=60)
    assert out.returncode == 2 and "--distinct-prompts must be >= 1, got 0" in out.stderr
