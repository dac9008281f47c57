"""A suite's life as `kvmesh up --detach`, `status` and `down` show it: up prints each service as it becomes ready;
a suite that is still starting (its `up` held with SIGSTOP right after the first service is ready, so the moment
is not a race) is one `status` reports as starting and `down` stops, launcher and services; `down` names each
service it stops; each run's planner history and logs live in the run's own directory, which `down` keeps as the
last run and the next `up` does not inherit. Real processes and signals, simulated workers."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from kvmesh.suite.observe import gone
from tests.support.cli import kvmesh_cli
from tests.support.poll import wait_until

pytestmark = [pytest.mark.integration]

UP = [
    "up",
    "--detach",
    "--ports",
    "auto",
    "--workers",
    "1",
    "--set",
    "worker.simSpeed=0",
    "--set",
    "planner.intervalS=1",
]
SERVICES = ["cache-manager", "worker", "router", "failover", "planner"]


class Up:
    """`kvmesh up` as a process whose output is read line by line (bounded by the process's own timeouts)."""

    def __init__(self, home: Path, *extra: str) -> None:
        env = {k: v for k, v in os.environ.items() if not k.startswith("KVMESH_") or k == "KVMESH_REQUIRE_NATIVE"}
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "kvmesh.suite.cli", *UP, *extra],
            env={**env, "KVMESH_HOME": str(home)},
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        self.lines: list[str] = []

    def until(self, text: str) -> str:
        """Reads lines until one contains `text` (AssertionError if up's output ends first)."""
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            self.lines.append(line)
            if text in line:
                return line
        raise AssertionError(
            f"no {text!r} in: {''.join(self.lines)}{self.proc.stderr.read() if self.proc.stderr else ''}"
        )

    def finish(self, timeout: float = 180) -> tuple[int, str, str]:
        out, err = self.proc.communicate(timeout=timeout)
        self.lines.append(out)
        return self.proc.returncode, "".join(self.lines), err


def _state(home: Path) -> dict[str, Any]:
    return json.loads((home / "run" / "suite.json").read_text())


def _pids(state: dict[str, Any]) -> list[int]:
    return [int(s["pid"]) for s in [*state["services"], *state.get("starting", [])]]


@pytest.fixture
def home(tmp_path: Path) -> Iterator[Path]:
    yield tmp_path / "home"
    kvmesh_cli(tmp_path / "home", "down", timeout=120)  # whatever a failed test left running


def test_status_and_down_know_a_starting_suite_and_runs_do_not_leak(home: Path) -> None:
    # run 1: held while starting, then let go
    up = Up(home)
    ready = up.until("ready  cache-manager")
    assert ready.split()[:2] == ["ready", "cache-manager"]
    os.kill(up.proc.pid, signal.SIGSTOP)
    try:
        held = _state(home)
        assert held["state"] == "starting" and held["launcher_pid"] == up.proc.pid
        status = kvmesh_cli(home, "status")
        assert status.returncode == 1, status.stdout
        assert status.stdout.startswith("suite starting for ") and f"(kvmesh up, pid {up.proc.pid})" in status.stdout
        assert "cache-manager" in status.stdout and "SERVING" in status.stdout
        assert "no suite is running" not in status.stdout
    finally:
        os.kill(up.proc.pid, signal.SIGCONT)
    code, out, err = up.finish()
    assert code == 0, out + err
    said = [line.split()[1] for line in out.splitlines() if line.startswith("  ready  ")]
    assert said == SERVICES, out  # each service named as it became ready, in start order
    state = _state(home)
    assert state["state"] == "running" and "launcher_pid" not in state and not state.get("starting")
    status = kvmesh_cli(home, "status")
    assert status.returncode == 0 and status.stdout.count("SERVING") == 5, status.stdout
    current = home / "run" / "current"
    assert Path(state["run_dir"]) == current and (current / "logs").is_dir()
    wait_until(lambda: (current / "planner-history-local.json").exists(), 30.0)  # its 1 s planning step ran

    down = kvmesh_cli(home, "down", timeout=120)
    assert down.returncode == 0, down.stdout + down.stderr
    stopped = [line.split()[1] for line in down.stdout.splitlines() if line.startswith("  stopping ")]
    assert stopped == SERVICES[::-1], down.stdout  # service by service, last started first
    assert all(line.rstrip().endswith("s)") for line in down.stdout.splitlines() if line.startswith("  stopping "))
    assert all(gone(pid) for pid in _pids(state))
    last = home / "run" / "last"
    assert not current.exists() and not (home / "run" / "suite.json").exists()
    assert (last / "planner-history-local.json").exists() and json.loads((last / "suite.json").read_text())
    run1_logs = sorted(p.name for p in (last / "logs").iterdir())
    assert len(run1_logs) >= 5

    # run 2: a fresh directory (no planner history, no logs of run 1); `down` while it is still starting
    up = Up(home)
    up.until("ready  cache-manager")
    os.kill(up.proc.pid, signal.SIGSTOP)
    held = _state(home)
    assert not (current / "planner-history-local.json").exists()  # nothing of run 1's: a fresh planner history
    run2_logs = [p.name for p in (current / "logs").iterdir()]  # the cache-manager's, the worker's if spawned
    assert run2_logs and not set(run2_logs) & set(run1_logs), run2_logs  # nothing of run 1's
    assert all(name.startswith(("cache-manager-", "worker-")) for name in run2_logs), run2_logs
    assert sorted(p.name for p in (last / "logs").iterdir()) == run1_logs  # run 1's kept for reading
    down = kvmesh_cli(home, "down", timeout=120)
    assert down.returncode == 0, down.stdout + down.stderr
    assert f"the suite is still starting: stopping its `kvmesh up` (pid {up.proc.pid}) first" in down.stdout
    assert "cache-manager" in down.stdout and "suite stopped" in down.stdout
    code, out, err = up.finish(60)
    assert code == 130 and "interrupted while starting: every service it had started was stopped" in err, out + err
    assert all(gone(pid) for pid in _pids(held)) and not (home / "run" / "suite.json").exists()
    assert kvmesh_cli(home, "status").stdout.startswith("no suite is running")
    logs = kvmesh_cli(home, "logs", "--last", "cache-manager", "--lines", "3")  # run 2's, as `down` kept it
    assert logs.returncode == 0 and logs.stdout.startswith("==> cache-manager-local-"), logs.stdout + logs.stderr
