"""`python -m kvmesh.bench kvsync --quick` prints the benchmark contract's JSON line, every row present."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from kvmesh.bench.kvsync import tiny_block_bytes, tiny_spec

pytestmark = pytest.mark.integration


def test_tiny_block_bytes_follows_the_tiny_model_spec() -> None:
    spec = tiny_spec()
    assert spec["num_hidden_layers"] == 2 and spec["num_key_value_heads"] == 2
    assert tiny_block_bytes() == 2 * 2 * 2 * 32 * 32 * 2 == 16384
    assert tiny_block_bytes({**spec, "num_hidden_layers": 4}) == 2 * 16384


def test_kvsync_bench_quick_prints_one_json_line_per_the_contract() -> None:
    out = subprocess.run(
        [sys.executable, "-m", "kvmesh.bench", "kvsync", "--quick"],
        capture_output=True,
        text=True,
        timeout=300,
        check=True,
    )
    lines = [ln for ln in out.stdout.splitlines() if ln.strip()]
    assert len(lines) == 1, out.stdout
    res = json.loads(lines[0])
    tiny = res["tiny_block_bytes"]
    assert tiny == 16384
    keys = {(r["transport"], r["blocks"], r["block_bytes"]) for r in res["results"]}
    assert keys == {(t, n, b) for t in ("shm", "grpc", "link") for n in (1, 8, 32, 128) for b in (tiny, 1 << 20)}
    for r in res["results"]:
        assert {"p50_ms", "p99_ms", "gbps"} <= r.keys()
        assert 0 < r["p50_ms"] <= r["p99_ms"] and r["gbps"] > 0
    for ref in ("memcpy", "socket"):
        assert {r["block_bytes"] for r in res[ref]} == {tiny, 1 << 20}
        assert all(r["gbps"] > 0 for r in res[ref])
    assert 0 < res["integrity_share"] < 1
    assert res["link_mode"].startswith(("netns+proxy", "loopback+proxy"))
    # the link adds a 1 ms round trip: a one-block pull over it (two RPCs) is slower than over loopback
    p50 = {(r["transport"], r["blocks"], r["block_bytes"]): r["p50_ms"] for r in res["results"]}
    assert p50[("link", 1, tiny)] > p50[("grpc", 1, tiny)] + 1.0
