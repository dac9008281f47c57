"""A process forked from an engine's process dies when that process is killed outright."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

# a parent that installs the hook (or not), forks a child and a grandchild through multiprocessing (fork, as
# vLLM starts its engine core and that its workers), prints their pids and waits to be killed
PARENT = """
import multiprocessing as mp, sys, time
from kvmesh.engine.orphans import exit_with_parent
if sys.argv[1] == "1":
    exit_with_parent()
ctx = mp.get_context("fork")
def grandchild():
    time.sleep(600)
def child(q):
    g = ctx.Process(target=grandchild)
    g.start()
    q.put(g.pid)
    time.sleep(600)
q = ctx.Queue()
c = ctx.Process(target=child, args=(q,))
c.start()
print(c.pid, q.get(), flush=True)
time.sleep(600)
"""


def alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as fh:
            return fh.read().split(")")[-1].split()[0] != "Z"  # a zombie has exited
    except FileNotFoundError:
        return False


def kill_parent_and_watch(install: bool, bound_s: float) -> list[int]:
    """The descendants still alive `bound_s` after their parent's SIGKILL (polled, no fixed sleep)."""
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[3] / "libs")}
    parent = subprocess.Popen(
        [sys.executable, "-c", PARENT, "1" if install else "0"], stdout=subprocess.PIPE, text=True, env=env
    )
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


def test_without_the_hook_a_killed_parents_forked_processes_live_on() -> None:
    assert len(kill_parent_and_watch(install=False, bound_s=3.0)) == 2


def test_with_the_hook_the_child_and_the_grandchild_die_with_their_parent() -> None:
    # the watch notices within WATCH_INTERVAL_S; the bound leaves room for a loaded machine
    assert kill_parent_and_watch(install=True, bound_s=15.0) == []
