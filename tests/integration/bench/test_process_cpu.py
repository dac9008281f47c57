"""`kvmesh.bench.process_cpu`: another process's CPU time read from its CPU-time clock, to the nanosecond, not
in /proc's 10 ms ticks (a router's few milliseconds over a short run read as 0 there), ended threads included."""

from __future__ import annotations

import os
import subprocess
import sys
import time

import pytest

from kvmesh.bench.process_cpu import cpu_seconds, process_cpu_s, tree_cpu_s

pytestmark = pytest.mark.integration

# burns CPU on a thread that then ends, reports its own CPU time, and waits for a line on stdin
CHILD = """
import sys, threading, time
def burn():
    t = time.process_time()
    while time.process_time() - t < 0.05:
        pass
th = threading.Thread(target=burn)
th.start()
th.join()
print(time.process_time(), flush=True)
sys.stdin.readline()
"""


def test_this_process_reads_between_two_readings_of_its_own_clock() -> None:
    """Truncated to ticks the reading would fall below `before` all but about 0.1 % of the time."""
    before = time.process_time()
    got = process_cpu_s(os.getpid())
    after = time.process_time()
    assert before <= got <= after


def test_another_process_counts_its_ended_thread_and_a_gone_one_reads_zero() -> None:
    child = subprocess.Popen([sys.executable, "-c", CHILD], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    assert child.stdin is not None and child.stdout is not None
    try:
        own = float(child.stdout.readline())  # the child's own reading, after its thread ended
        got = process_cpu_s(child.pid)
        assert own >= 0.05
        assert own <= got < own + 0.05  # the child only blocks on stdin after its reading
        assert cpu_seconds([child.pid, child.pid]) == pytest.approx(2 * got, abs=0.01)
        mine = process_cpu_s(os.getpid())
        assert tree_cpu_s(os.getpid()) >= mine + got  # the child is in this process's tree (and idle meanwhile)
    finally:
        child.stdin.close()
        child.wait(timeout=30)
    assert process_cpu_s(child.pid) == 0.0
