"""A process forked from an engine's process dies when that process is killed outright."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from kvmesh.bench.chaos_runner import start_ticks

# a parent that starts a child and a grandchild through multiprocessing (as vLLM starts its engine core and
# that its model workers), each watching its parent or not, prints their pids and waits to be killed
PARENT = """
import multiprocessing as mp, sys, time
from kvmesh.core.orphans import exit_with_parent, watch_parent_in_child
mode = sys.argv[1]
if mode == "fork-hook":
    exit_with_parent()
ctx = mp.get_context("spawn" if mode == "spawn-plugin" else "fork")
def grandchild():
    if mode == "spawn-plugin":
        watch_parent_in_child()  # what vLLM's general plugin runs in each process it starts
    time.sleep(600)
def child(q):
    if mode == "spawn-plugin":
        watch_parent_in_child()
    g = ctx.Process(target=grandchild)
    g.start()
    q.put(g.pid)
    time.sleep(600)
if __name__ == "__main__":
    assert watch_parent_in_child() is False  # the worker itself: not a multiprocessing child, no watch
    q = ctx.Queue()
    c = ctx.Process(target=child, args=(q,))
    c.start()
    print(c.pid, q.get(), flush=True)
    time.sleep(600)
"""


def alive(pid: int) -> bool:
    return start_ticks(pid) is not None  # None once gone, or a zombie (it has exited)


def kill_parent_and_watch(mode: str, bound_s: float, tmp: Path) -> list[int]:
    """The descendants still alive `bound_s` after their parent's SIGKILL (polled, no fixed sleep)."""
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[3] / "libs")}
    script = tmp / "parent.py"  # a file: spawned children import the parent's main module by path
    script.write_text(PARENT)
    parent = subprocess.Popen([sys.executable, str(script), mode], stdout=subprocess.PIPE, text=True, env=env)
    assert parent.stdout is not None
    pids = [int(x) for x in parent.stdout.readline().split()]
    try:
        assert len(pids) == 2 and all(alive(p) for p in pids)
        parent.send_signal(signal.SIGKILL)
        parent.wait(10)
        deadline = time.monotonic() + bound_s
        while any(alive(p) for p in pids) and time.monotonic() < deadline:
            time.sleep(0.05)  # polling the processes' state until the bound
        return [p for p in pids if alive(p)]
    finally:
        parent.kill()
        for p in pids:
            if alive(p):
                os.kill(p, signal.SIGKILL)


def test_without_a_watch_a_killed_parents_forked_processes_live_on(tmp_path: Path) -> None:
    assert len(kill_parent_and_watch("none", bound_s=3.0, tmp=tmp_path)) == 2


@pytest.mark.parametrize("mode", ["fork-hook", "spawn-plugin"])
def test_with_a_watch_the_child_and_the_grandchild_die_with_their_parent(mode: str, tmp_path: Path) -> None:
    # the watch notices within WATCH_INTERVAL_S; the bound leaves room for a loaded machine
    assert kill_parent_and_watch(mode, bound_s=15.0, tmp=tmp_path) == []
