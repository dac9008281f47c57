"""The chaos final pass's index reference: a worker's full dump ingested as the cache-manager would."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import time

from kvmesh.bench.chaos_runner import _ppid, descendants, indexed_from_dump, kill_descendants, start_ticks
from kvmesh.cachemgr.hasher import IndexHasher
from kvmesh.core.kvevents import BlockStored

BS = 4
MODEL = "chaos-model"


def block(h: int, parent: int | None, first_token: int) -> BlockStored:
    return BlockStored((h,), parent, tuple(range(first_token, first_token + BS)), BS)


def test_a_dump_gives_the_index_hashes_of_its_chains_and_names_its_orphans() -> None:
    # 1 -> 2 -> 3 chained; 5's parent 4 was evicted, so 5 and its child 6 are orphans
    dump = [block(1, None, 0), block(2, 1, 4), block(5, 4, 12), block(3, 2, 8), block(6, 5, 16)]
    got = indexed_from_dump("w0", dump, BS, MODEL)
    assert got.indexed == set(IndexHasher(MODEL).chain(None, list(range(12)), BS, None))
    assert got.orphans == {5, 6}


def test_a_killed_processs_children_are_found_and_named_as_orphans_then_killed() -> None:
    # a parent with a child that outlives it (no hook: what a SIGKILLed vLLM worker's engine core did)
    code = "import subprocess,sys,time; c=subprocess.Popen([sys.executable,'-c','import time; time.sleep(600)']);"
    code += "print(c.pid, flush=True); time.sleep(600)"
    parent = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)
    assert parent.stdout is not None
    child = int(parent.stdout.readline())
    try:
        found = descendants(parent.pid)
        assert child in found
        known = {pid: (start_ticks(pid) or 0, "a/worker-0") for pid in found}
        parent.kill()
        parent.wait(10)
        assert start_ticks(child) == known[child][0] and _ppid(child) != parent.pid  # alive, re-parented
        kill_descendants(known)
        deadline = time.monotonic() + 10
        while start_ticks(child) is not None and time.monotonic() < deadline:
            time.sleep(0.05)  # polling until the kernel has reaped it
        assert start_ticks(child) is None
    finally:
        parent.kill()
        with contextlib.suppress(ProcessLookupError):
            os.kill(child, signal.SIGKILL)
