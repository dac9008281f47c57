"""A SIGKILLed process group's shared memory is removed once nothing maps it; a segment still mapped stays."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from multiprocessing import shared_memory

from kvmesh.suite.shm_leftovers import mapped_by_group, unlink_unmapped

CHILD = """
import sys
from multiprocessing import shared_memory
own = shared_memory.SharedMemory(create=True, size=4096, name=sys.argv[1])
peer = shared_memory.SharedMemory(name=sys.argv[2])  # a segment someone else (the test) keeps mapped
print("ready", flush=True)
sys.stdin.readline()
"""


def test_a_killed_groups_own_segment_goes_and_a_shared_one_stays() -> None:
    own, kept = f"kvmesh-leftover-{os.getpid()}-own", f"kvmesh-leftover-{os.getpid()}-kept"
    shared = shared_memory.SharedMemory(create=True, size=4096, name=kept)
    proc = subprocess.Popen(
        [sys.executable, "-c", CHILD, own, kept], stdin=subprocess.PIPE, stdout=subprocess.PIPE, start_new_session=True
    )
    try:
        assert proc.stdout is not None and proc.stdout.readline().strip() == b"ready"
        segments = mapped_by_group(proc.pid)
        assert {f"/dev/shm/{own}", f"/dev/shm/{kept}"} <= segments
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(timeout=10)
        assert os.path.exists(f"/dev/shm/{own}")  # SIGKILL unlinks nothing by itself
        removed = unlink_unmapped(segments)
        assert f"/dev/shm/{own}" in removed and not os.path.exists(f"/dev/shm/{own}")
        assert os.path.exists(f"/dev/shm/{kept}")  # still mapped here
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
        shared.close()
        shared.unlink()
        if os.path.exists(f"/dev/shm/{own}"):
            os.unlink(f"/dev/shm/{own}")
