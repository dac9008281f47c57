"""Shared-memory segments a killed process group leaves in /dev/shm.

A process killed with SIGKILL never unlinks its POSIX shared memory: vLLM's message queues between its
engine core and model workers (`psm_*`, hundreds of MB each) stay in /dev/shm, i.e. in RAM, until reboot.
`mapped_by_group(pgid)` lists the segments the group's processes map (read before the kill);
`unlink_unmapped(paths)` removes those no live process maps any more (a peer still reading one keeps it).
Linux /proc only; elsewhere both do nothing.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterable, Iterator

SHM = "/dev/shm/"


def _pids() -> Iterator[int]:
    with contextlib.suppress(OSError):
        for entry in os.listdir("/proc"):
            if entry.isdigit():
                yield int(entry)


def _maps(pid: int) -> set[str]:
    """The /dev/shm files process `pid` maps (empty if it is gone or unreadable)."""
    try:
        with open(f"/proc/{pid}/maps") as f:
            lines = f.read().splitlines()
    except OSError:
        return set()
    out = set()
    for line in lines:
        i = line.find(SHM)
        if i >= 0:
            out.add(line[i:].removesuffix(" (deleted)"))
    return out


def mapped_by_group(pgid: int) -> set[str]:
    """The /dev/shm segments mapped by the processes of process group `pgid`."""
    found: set[str] = set()
    for pid in _pids():
        with contextlib.suppress(OSError):
            if os.getpgid(pid) == pgid:
                found |= _maps(pid)
    return found


def unlink_unmapped(paths: Iterable[str]) -> list[str]:
    """Unlinks those of `paths` that no live process maps; returns the ones removed."""
    wanted = {p for p in paths if os.path.exists(p)}
    if not wanted:
        return []
    for pid in _pids():
        wanted -= _maps(pid)
        if not wanted:
            return []
    removed = []
    for p in sorted(wanted):
        with contextlib.suppress(FileNotFoundError):
            os.unlink(p)
            removed.append(p)
    return removed
