"""CPU time of other processes, for the benchmarks' CPU-per-request figures (Linux).

`process_cpu_s(pid)` reads the process's CPU-time clock (``clock_gettime`` on the clock id glibc's
``clock_getcpuclockid`` makes: ``(~pid << 3) | CPUCLOCK_SCHED``): user + system time of every thread, ended ones
included, to the nanosecond. ``/proc/PID/stat``'s utime and stime count in clock ticks (10 ms here), so a router
that spent 9 ms on a short run read as 0 or 10 ms; /proc stays the fallback where the clock is refused.
"""

from __future__ import annotations

import os
import time
from collections.abc import Sequence
from pathlib import Path

_CPUCLOCK_SCHED = 2  # the kernel's process clock that sums the scheduler's runtime of every thread


def stat_fields(pid: int) -> list[str] | None:
    """/proc/<pid>/stat's fields after the command name: state, ppid, ..., utime (field 14 of proc(5)) and stime
    (15) at offsets 11 and 12, starttime (22) at 19; None when the process is gone."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except (OSError, IndexError):
        return None


def process_cpu_s(pid: int) -> float:
    """User + system CPU seconds of process `pid` so far; 0.0 when it is gone."""
    try:
        return time.clock_gettime((~pid << 3) | _CPUCLOCK_SCHED)
    except OSError:
        pass
    fields = stat_fields(pid)
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK") if fields else 0.0


def cpu_seconds(pids: Sequence[int]) -> float:
    """CPU seconds of the given processes so far, summed."""
    return sum(map(process_cpu_s, pids))


def tree_cpu_s(pid: int) -> float:
    """CPU seconds of process `pid` and its live descendants so far."""
    parent: dict[int, int] = {}
    for d in Path("/proc").iterdir():
        fields = stat_fields(int(d.name)) if d.name.isdigit() else None
        if fields:
            parent[int(d.name)] = int(fields[1])
    tree, grew = {pid}, True
    while grew:
        more = {p for p, pp in parent.items() if pp in tree} - tree
        tree |= more
        grew = bool(more)
    return cpu_seconds(sorted(tree))


def host_busy_s() -> float:
    """Busy CPU seconds of the whole machine since boot, all cores (Linux /proc/stat: every state but idle and
    iowait)."""
    fields = [int(x) for x in Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:]]
    return (sum(fields[:8]) - fields[3] - fields[4]) / os.sysconf("SC_CLK_TCK")  # guest time is in user already
