"""`python -m kvmesh.bench zone-follow` with a partition under traffic: one JSON line, and zone B came back by
one resumed stream that carried exactly the batches published while the link was cut (no snapshot)."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

pytestmark = pytest.mark.integration


def test_zone_follow_bench_heals_a_partition_without_a_resend() -> None:
    cmd = [sys.executable, "-m", "kvmesh.bench", "zone-follow", "--duration", "3", "--partition-s", "1"]
    out = subprocess.run([*cmd, "--batches-per-s", "100"], capture_output=True, text=True, timeout=300, check=True)
    lines = [ln for ln in out.stdout.splitlines() if ln.strip()]
    assert len(lines) == 1, out.stdout
    res = json.loads(lines[0])
    assert res["batches"] == 300 and res["index_lag_ms"]["samples"] > 0
    p = res["partition"]
    assert (p["resumed_streams"], p["snapshot_streams"]) == (1, 0)
    assert p["resumed_deltas"] == p["missed_batches"] == 100
