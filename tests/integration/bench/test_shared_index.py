"""`python -m kvmesh.bench shared-index` (docs/benchmarks.md): a reader process answers from the writer's shared
index, holds no copy of it, and the files are gone afterwards."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from kvmesh.index import NATIVE

pytestmark = [pytest.mark.integration, pytest.mark.skipif(not NATIVE, reason="the shared index is the compiled one")]


def test_the_bench_prints_one_line_with_a_reader_that_holds_no_copy() -> None:
    before = {f for f in os.listdir("/dev/shm") if f.startswith("kvmesh-bench-")}
    cmd = [sys.executable, "-m", "kvmesh.bench", "shared-index", "--blocks", "200000", "--queries", "300"]
    out = subprocess.run(cmd, check=True, capture_output=True, text=True, timeout=300).stdout.splitlines()
    assert len(out) == 1
    got = json.loads(out[0])
    assert got["blocks"] == 200000 // 512 * 512 and got["pairs"] >= got["blocks"]
    # the shared files are one copy, as large as a private one; the reader maps them and holds ~none of it
    assert abs(got["shared_file_bytes"] - got["private_copy_bytes"]) < 0.05 * got["private_copy_bytes"]
    assert got["reader_private_bytes"] < 0.5 * got["shared_file_bytes"]
    assert set(got["query_us"]["shared_reader"]) == set(got["query_us"]["private"]) == {"64", "512"}
    assert {f for f in os.listdir("/dev/shm") if f.startswith("kvmesh-bench-")} == before
