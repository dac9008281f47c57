"""`python -m kvmesh.bench grpc-hop` runs its three processes and reports a proxy hop that costs time, and the
CPU per call of a bare grpc.aio server and of a bare proxy."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

pytestmark = pytest.mark.integration

HOP = [sys.executable, "-m", "kvmesh.bench", "grpc-hop"]


def test_grpc_hop_bench_prints_one_json_line_with_a_positive_hop() -> None:
    out = subprocess.run(
        [*HOP, "--calls", "60", "--payload-bytes", "4096", "--concurrent-calls", "600", "--concurrency", "8"],
        capture_output=True,
        text=True,
        timeout=120,
        check=True,
    )
    lines = [ln for ln in out.stdout.splitlines() if ln.strip()]
    assert len(lines) == 1, out.stdout
    res = json.loads(lines[0])
    assert res["bench"] == "grpc-hop" and res["calls"] == 60 and res["payload_bytes"] == 4096
    assert len(res["direct_p50_ms"]) == len(res["proxy_p50_ms"]) == 2
    assert all(d > 0 for d in res["direct_p50_ms"])
    # a proxied call makes two calls: it can never be faster than the direct one in both rounds
    assert any(p > d for p, d in zip(res["proxy_p50_ms"], res["direct_p50_ms"], strict=True))
    diffs = [p - d for p, d in zip(res["proxy_p50_ms"], res["direct_p50_ms"], strict=True)]
    assert res["hop_ms"] == pytest.approx(sum(diffs) / 2, abs=0.002)  # the median of two = their mean
    assert res["concurrent_calls"] == 600 and res["concurrency"] == 8 and res["concurrent_calls_per_s"] > 0
    # the proxy serves the same calls as the echo server and makes a client call for each on top
    assert 0 < res["echo_cpu_us_per_call"] < res["proxy_cpu_us_per_call"]


def test_grpc_hop_bench_refuses_a_concurrency_below_one() -> None:
    out = subprocess.run([*HOP, "--concurrency", "0"], capture_output=True, text=True, timeout=60)
    assert out.returncode == 2 and "--concurrent-calls and --concurrency must be at least 1" in out.stderr
