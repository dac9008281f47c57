"""An inter-zone link for tests: `kvmesh.bench.delay_proxy` as a process that can be cut and healed."""

from __future__ import annotations

import subprocess
import sys


class Link:
    """A delay proxy to `target`; `cut()` kills it (its connections die), `heal()` restarts it on the same port."""

    def __init__(self, target: str, delay_ms: float = 0.0) -> None:
        self.target, self.delay_ms = target, delay_ms
        self.port = 0
        self.proc = self._start()

    def _start(self) -> subprocess.Popen[str]:
        cmd = [sys.executable, "-m", "kvmesh.bench.delay_proxy", "--target", self.target]
        cmd += ["--delay-ms", str(self.delay_ms), "--port", str(self.port)]
        proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, text=True)
        assert proc.stdout is not None
        line = proc.stdout.readline()
        assert line, f"the delay proxy exited with {proc.wait(timeout=10)}"
        self.port = int(line)
        return proc

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.port}"

    def cut(self) -> None:
        self.proc.kill()
        self.proc.wait(timeout=30)

    def heal(self) -> None:
        self.proc = self._start()

    def close(self) -> None:
        if self.proc.poll() is None:
            self.cut()
