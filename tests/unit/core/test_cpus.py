"""`kvmesh.core.cpus`: co-located engines get disjoint cores, CPU lists parse as Linux writes them, and pinning
a process covers the threads it already has and the processes it starts later."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from kvmesh.core.cpus import core_shares, parse_cpu_list, pin_process
from kvmesh.core.errors import InvalidArgument
from kvmesh.suite.launcher import vllm_core_env

pytestmark = pytest.mark.unit


def test_core_shares_are_disjoint_and_cover_the_cpus() -> None:
    assert core_shares(list(range(16)), 2) == ["0,1,2,3,4,5,6,7", "8,9,10,11,12,13,14,15"]
    assert core_shares([1, 0], 2) == ["0", "1"]
    assert core_shares([0, 1, 2], 2) == ["0", "1"]
    assert core_shares([5], 3) == ["5", "5", "5"]  # fewer cpus than workers: they must share


def test_cpu_lists_parse_like_taskset_writes_them() -> None:
    assert parse_cpu_list("0-3,8,10-11") == {0, 1, 2, 3, 8, 10, 11}
    assert parse_cpu_list("5") == {5} and parse_cpu_list("0, 2") == {0, 2}
    for bad in ("", "a", "3-1", "1-", "-2", "0,,1"):
        with pytest.raises(InvalidArgument) as ei:
            parse_cpu_list(bad)
        assert ei.value.field == "cpu_affinity"


def test_pinned_vllm_workers_pin_the_whole_worker_process_to_the_engines_cores() -> None:
    envs = vllm_core_env(2)
    assert [e["KVMESH_WORKER_CPU_AFFINITY"] for e in envs] == [e["VLLM_CPU_OMP_THREADS_BIND"] for e in envs]
    assert all("KVMESH_WORKER_CPU_AFFINITY" not in e for e in vllm_core_env(2, pinned=False))


PIN_SCRIPT = """
import os, subprocess, sys, threading
from kvmesh.core.cpus import pin_process
go, seen = threading.Event(), []
t = threading.Thread(target=lambda: (go.wait(), seen.append(os.sched_getaffinity(0))))
t.start()  # a thread that exists before the pin
pin_process({cpu})
go.set(); t.join()
child = subprocess.run([sys.executable, "-c", "import os; print(sorted(os.sched_getaffinity(0)))"],
                       capture_output=True, text=True, check=True).stdout.strip()
print(sorted(os.sched_getaffinity(0)), sorted(seen[0]), child)
"""


def test_pin_process_covers_existing_threads_and_later_children() -> None:
    cpu = max(os.sched_getaffinity(0))
    out = subprocess.run(
        [sys.executable, "-c", PIN_SCRIPT.format(cpu={cpu})], capture_output=True, text=True, timeout=60, check=True
    ).stdout.split()
    assert out == [f"[{cpu}]"] * 3


def test_pinning_outside_the_allowed_cpus_is_refused() -> None:
    with pytest.raises(InvalidArgument) as ei:
        pin_process({max(os.sched_getaffinity(0)) + 1000})
    assert "not all among" in ei.value.message
