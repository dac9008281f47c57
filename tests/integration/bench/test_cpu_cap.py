"""`kvmesh.bench.cpu_cap.CpuCaps` on this machine's real cgroups: a capped process runs in a cgroup of its own
and gets no more CPU than its cap; closing moves it back and removes the cgroup."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from kvmesh.bench.cpu_cap import CpuCaps, cgroup_of
from kvmesh.bench.process_cpu import tree_cpu_s

pytestmark = pytest.mark.integration


@pytest.fixture
def spinner() -> Iterator[subprocess.Popen[bytes]]:
    proc = subprocess.Popen([sys.executable, "-c", "while True: pass"])
    yield proc
    proc.kill()
    proc.wait(timeout=10)


def test_a_capped_process_gets_no_more_than_its_cap_and_is_released_on_close(
    spinner: subprocess.Popen[bytes],
) -> None:
    assert cgroup_of(spinner.pid) == cgroup_of(os.getpid())
    with CpuCaps(0.2) as caps:
        group = caps.cap(spinner.pid)
        assert cgroup_of(spinner.pid).endswith(group.name)
        # a loop that would burn a whole core unchecked: 0.3 s of its CPU takes at least 1.5 s at 0.2 of a core
        cpu0, t0 = tree_cpu_s(spinner.pid), time.monotonic()
        while tree_cpu_s(spinner.pid) - cpu0 < 0.3 and time.monotonic() - t0 < 30:
            time.sleep(0.01)
        cpu, wall = tree_cpu_s(spinner.pid) - cpu0, time.monotonic() - t0
        assert cpu >= 0.3, "the capped process stopped running"
        # the cap, less one period's quota (the window's edges) and two clock ticks of accounting
        assert wall >= (cpu - 0.02 - 0.02) / 0.2
    assert cgroup_of(spinner.pid) == cgroup_of(os.getpid())
    assert not Path(group).exists()


def test_a_cap_outside_the_machine_s_cores_is_refused() -> None:
    for cores in (0, -1, (os.cpu_count() or 1) + 1):
        with pytest.raises(ValueError, match="cores must be in"):
            CpuCaps(cores)


ROUTER_BENCH = [sys.executable, "-m", "kvmesh.bench", "router", "--workers", "2", "--prompt-tokens", "64"]


def test_the_router_bench_caps_every_router_process_and_leaves_no_cgroup_behind() -> None:
    args = ["--requests", "40", "--c1-requests", "4", "--concurrency", "4", "--router-processes", "2"]
    args += ["--router-connections", "2"]
    proc = subprocess.Popen(
        [*ROUTER_BENCH, *args, "--router-cpu-cap", "0.5"], stdout=subprocess.PIPE, stderr=subprocess.PIPE
    )
    out, err = proc.communicate(timeout=180)
    assert proc.returncode == 0, err.decode()[-2000:]
    res = json.loads(out.decode().strip().splitlines()[-1])
    assert res["router_cpu_cap"] == 0.5 and res["router_processes"] == 2
    assert res["router_cpu_capped"] == 2  # both copies, not their supervisor
    assert res["router_connections"] == 2
    assert res["router"]["64"]["c4_rps"] > 0
    base = CpuCaps(0.5).base
    assert not list(base.glob(f"kvmesh-bench-{proc.pid}-*"))


def test_the_router_bench_refuses_a_cap_outside_the_cores() -> None:
    out = subprocess.run([*ROUTER_BENCH, "--router-cpu-cap", "-1"], capture_output=True, text=True, timeout=60)
    assert out.returncode == 2 and "--router-cpu-cap: cores must be in" in out.stderr


def test_router_connections_apply_to_grpc_only_and_from_one() -> None:
    for bad in (["--router-connections", "-1"], ["--api", "http", "--router-connections", "2"]):
        out = subprocess.run([*ROUTER_BENCH, *bad], capture_output=True, text=True, timeout=60)
        assert out.returncode == 2 and "--router-connections must be >= 1, and applies to --api grpc only" in out.stderr
