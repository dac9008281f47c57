"""CPU caps for bench processes, with Linux cgroups: a stand-in for a host where a process has cores of its own.

On a shared bench machine the client, the workers and the router compete for the same cores, so a second
router process cannot show what it adds: the machine runs out first. Capping each router process at a fixed
share of a core makes the routers the limit, as on a fleet where the router has its own cores and the
workers are GPUs elsewhere; the rest of the machine keeps the CPU it needs.

`CpuCaps(cores)` makes one cgroup per capped process, each allowed `cores` of CPU time per scheduling
period (cgroup v1 `cpu.cfs_quota_us`, or v2 `cpu.max` where the cpu controller is on the unified hierarchy);
`cap(pid)` moves a process, all its threads, into a cgroup of its own; `close()` moves whatever is left back
to the parent and removes the cgroups. Needs root and a cpu controller (`CpuCapError` says which is missing).
"""

from __future__ import annotations

import contextlib
import os
from pathlib import Path

PERIOD_US = 100_000
V1_CPU = Path("/sys/fs/cgroup/cpu")
V2_ROOT = Path("/sys/fs/cgroup")


class CpuCapError(RuntimeError):
    """No cgroup cpu controller this process may write to."""


def _hierarchy() -> tuple[Path, str]:
    """(the cgroup to create caps under, "v1" or "v2")."""
    if (V1_CPU / "cpu.cfs_quota_us").exists():
        return V1_CPU, "v1"
    controllers = V2_ROOT / "cgroup.controllers"
    if controllers.exists() and "cpu" in controllers.read_text().split():
        return V2_ROOT, "v2"
    raise CpuCapError("no cgroup cpu controller: neither /sys/fs/cgroup/cpu (v1) nor cpu in cgroup.controllers (v2)")


class CpuCaps:
    """See the module docstring."""

    def __init__(self, cores: float) -> None:
        most = os.cpu_count() or 1
        if not 0 < cores <= most:
            raise ValueError(f"cores must be in (0, {most}], got {cores}")
        self.cores = cores
        self.base, self.version = _hierarchy()
        self.groups: list[Path] = []
        if self.version == "v2":
            self._write(self.base / "cgroup.subtree_control", "+cpu")

    def cap(self, pid: int) -> Path:
        """Moves process `pid` (every thread of it, and what it starts later) into a new cgroup of its own,
        capped at `cores`; returns the cgroup."""
        group = self.base / f"kvmesh-bench-{os.getpid()}-{len(self.groups)}"
        try:
            group.mkdir()
        except OSError as exc:
            raise CpuCapError(f"cannot create {group}: {exc.strerror} (root is needed)") from exc
        self.groups.append(group)
        quota = max(1000, round(self.cores * PERIOD_US))  # the kernel's least quota is 1 ms
        if self.version == "v1":
            self._write(group / "cpu.cfs_period_us", str(PERIOD_US))
            self._write(group / "cpu.cfs_quota_us", str(quota))
        else:
            self._write(group / "cpu.max", f"{quota} {PERIOD_US}")
        self._write(group / "cgroup.procs", str(pid))
        try:
            now_in = cgroup_of(pid)
        except OSError as exc:
            raise CpuCapError(f"process {pid} is gone: {exc.strerror}") from exc
        if not now_in.endswith("/" + group.name):
            raise CpuCapError(f"process {pid} is in cgroup {now_in}, not {group.name}")
        return group

    def close(self) -> None:
        """Moves processes still in the caps back to the parent cgroup and removes the caps."""
        for group in self.groups:
            with contextlib.suppress(OSError):
                for pid in (group / "cgroup.procs").read_text().split():
                    with contextlib.suppress(OSError):  # exited meanwhile
                        (self.base / "cgroup.procs").write_text(pid)
            with contextlib.suppress(OSError):
                group.rmdir()
        self.groups.clear()

    def __enter__(self) -> CpuCaps:
        return self

    def __exit__(self, *_: object) -> None:
        self.close()

    @staticmethod
    def _write(path: Path, value: str) -> None:
        try:
            path.write_text(value)
        except OSError as exc:
            raise CpuCapError(f"cannot write {value!r} to {path}: {exc.strerror}") from exc


def cgroup_of(pid: int) -> str:
    """The cpu cgroup of process `pid`, as /proc/<pid>/cgroup names it ("/" at the root)."""
    for line in Path(f"/proc/{pid}/cgroup").read_text().splitlines():
        _, controllers, path = line.split(":", 2)
        if "cpu" in controllers.split(",") or (controllers == "" and _hierarchy()[1] == "v2"):
            return path
    return "/"
