"""Start / stop the Consul STAND-IN as a real process (for tests); readiness = its ``{"port": N}`` line."""

from __future__ import annotations

import json
import os
import select
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


@dataclass
class StandinProcess:
    proc: subprocess.Popen[str]
    port: int
    args: tuple[str, ...]

    def stop(self, timeout_s: float = 5.0) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGCONT)
            self.proc.terminate()
            try:
                self.proc.wait(timeout_s)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(timeout_s)

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(5)

    def pause(self) -> None:
        """SIGSTOP: the agent stops answering but keeps its sockets (a hung Consul)."""
        self.proc.send_signal(signal.SIGSTOP)

    def resume(self) -> None:
        self.proc.send_signal(signal.SIGCONT)


def start_standin(
    port: int = 0,
    data_dir: Path | None = None,
    reap_interval_s: float = 30.0,
    timeout_s: float = 20.0,
    hosts: tuple[str, ...] = ("127.0.0.1",),
) -> StandinProcess:
    args = ["--port", str(port), "--reap-interval", str(reap_interval_s)]
    for h in hosts:
        args += ["--host", h]
    if data_dir is not None:
        args += ["--data-dir", str(data_dir)]
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")]))
    proc = subprocess.Popen(
        [sys.executable, "-m", "tests.consul_standin", *args],
        cwd=REPO,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.DEVNULL,
        text=True,
    )
    assert proc.stdout is not None
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        ready, _, _ = select.select([proc.stdout], [], [], max(0.0, deadline - time.monotonic()))
        if ready:
            line = proc.stdout.readline()
            if not line:
                break
            return StandinProcess(proc, int(json.loads(line)["port"]), tuple(args))
    proc.kill()
    proc.wait(5)
    raise RuntimeError(f"consul stand-in did not start within {timeout_s}s (rc={proc.poll()})")
