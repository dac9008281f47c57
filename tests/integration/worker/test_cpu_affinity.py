"""`kvmesh-worker --cpu-affinity`: the worker process and every thread it runs are pinned to the given CPUs
(what `kvmesh up --engine vllm` and `kvmesh.bench balance` give co-located vLLM workers, so that each engine
and its frontend own their cores); a bad list stops the start with a message naming the setting."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from kvmesh.suite.launcher import start_service

pytestmark = pytest.mark.integration


def allowed(pid: int) -> set[str]:
    """Cpus_allowed_list of every thread of `pid`."""
    out = set()
    for task in Path(f"/proc/{pid}/task").iterdir():
        for line in (task / "status").read_text().splitlines():
            if line.startswith("Cpus_allowed_list:"):
                out.add(line.split()[1])
    return out


def test_every_thread_of_the_worker_runs_on_its_cpus(tmp_path: Path) -> None:
    cpu = str(max(os.sched_getaffinity(0)))
    w = start_service("worker", tmp_path, "--engine", "sim", "--cpu-affinity", cpu, timeout=60)
    try:
        assert allowed(w.proc.pid) == {cpu}
    finally:
        assert w.terminate(timeout=30) == 0


def test_a_bad_cpu_list_stops_the_start_naming_the_setting(tmp_path: Path) -> None:
    with pytest.raises(RuntimeError) as ei:
        start_service("worker", tmp_path, "--engine", "sim", "--cpu-affinity", "3-1", timeout=60)
    assert "exited with 2" in str(ei.value) and "cpu_affinity" in str(ei.value)
