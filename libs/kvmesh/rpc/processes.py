"""Several processes of one service behind one pair of ports (`kvmesh-router --processes N`).

The supervisor reserves the gRPC and HTTP ports (a bound, non-listening SO_REUSEPORT socket each, so a
port 0 is fixed once and no one else takes it), starts N copies of the service with `--reuse-port` on those
ports and each with its own /metrics port (a scrape of the shared port lands on any one of them): copy i on
`--process-http-port` + i where the supervisor was given one (fixed ports, e.g. a pod's declared container
ports), else an ephemeral one (listed in the ready file); `--plain-http-port` likewise. It waits until every
copy is ready, then writes one ready file naming the shared ports and every process. The kernel spreads new
connections over the copies.

It restarts a copy that dies (at most `MAX_RESTARTS` in `RESTART_WINDOW_S`, then it stops them all and
fails), forwards SIGTERM/SIGINT to every copy and waits for them to drain. Each copy gets SIGTERM if the
supervisor itself dies (PR_SET_PDEATHSIG), so none outlives it.
"""

from __future__ import annotations

import contextlib
import ctypes
import json
import logging
import os
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from kvmesh.core.config import ServerSettings
from kvmesh.rpc.server import write_ready_file

log = logging.getLogger(__name__)

MAX_PROCESSES = 8  # `--processes 0`: one per core, at most this many
MAX_RESTARTS, RESTART_WINDOW_S = 5, 60.0
READY_TIMEOUT_S = 120.0
_PR_SET_PDEATHSIG = 1


def process_count(requested: int, cores: int | None = None) -> int:
    """`requested`, or for 0 one per core of this process's CPU set, at most `MAX_PROCESSES`."""
    if requested < 0:
        raise ValueError(f"processes: must be >= 0 (0 = one per core), got {requested}")
    if requested:
        return requested
    return max(1, min(cores if cores is not None else len(os.sched_getaffinity(0)), MAX_PROCESSES))


@dataclass
class _Copy:
    index: int
    proc: subprocess.Popen[bytes]
    ready: Path
    info: dict[str, Any] = field(default_factory=dict)


def _die_with_parent() -> None:
    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_PDEATHSIG, signal.SIGTERM)


def _reserve(host: str, port: int) -> socket.socket:
    sock = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
    sock.bind((host, port))
    return sock


class Supervisor:
    """N copies of `python -m <module> <argv>` sharing `settings`' ports (see the module docstring);
    `extra(i)` adds copy i's own flags (e.g. the router's replica count)."""

    def __init__(
        self,
        name: str,
        module: str,
        argv: Sequence[str],
        settings: ServerSettings,
        n: int,
        extra: Callable[[int], list[str]],
    ) -> None:
        self.name, self.module, self.argv, self.settings, self.n, self.extra = (
            name,
            module,
            list(argv),
            settings,
            n,
            extra,
        )
        self.stop = threading.Event()
        self.copies: list[_Copy] = []
        self.restarts: list[float] = []
        self._dir = Path(tempfile.mkdtemp(prefix=f"kvmesh-{name}-"))
        self._reserved = [_reserve(settings.host, settings.port)]
        self.grpc_port = self._reserved[0].getsockname()[1]
        self.http_port: int | None = None
        if settings.http_port >= 0:
            self._reserved.append(_reserve(settings.host, settings.http_port))
            self.http_port = self._reserved[1].getsockname()[1]
        self.base_id = settings.service_id or f"{name}-{settings.zone}-{self.grpc_port}"

    def run(self) -> int:
        for sig in (signal.SIGTERM, signal.SIGINT):
            signal.signal(sig, lambda *_: self.stop.set())
        try:
            self.copies = [self._spawn(i) for i in range(self.n)]
            for c in self.copies:
                self._await_ready(c)
            self._write_ready_file()
            log.info("%s: %d processes serving gRPC on %s:%d", self.name, self.n, self.settings.host, self.grpc_port)
            return self._watch()
        except (OSError, TimeoutError, RuntimeError) as exc:
            log.error("%s failed: %s", self.name, exc)
            return 2
        finally:
            self._stop_all()

    def _spawn(self, i: int) -> _Copy:
        ready = self._dir / f"{i}-{time.monotonic_ns()}.json"
        flags = ["--processes", "1", "--reuse-port", "true", "--port", str(self.grpc_port)]
        flags += ["--http-port", str(self.http_port if self.http_port is not None else -1)]
        own_port = self.settings.process_http_port + i if self.settings.process_http_port > 0 else 0
        flags += ["--process-http-port", str(own_port), "--ready-file", str(ready)]
        plain = self.settings.plain_http_port  # a fixed one as the --process-http-port: copy i on it + i
        flags += ["--plain-http-port", str(plain + i if plain > 0 else plain)]
        flags += ["--service-id", f"{self.base_id}-p{i}"]
        cmd = [sys.executable, "-m", self.module, *self.argv, *flags, *self.extra(i)]
        return _Copy(i, subprocess.Popen(cmd, preexec_fn=_die_with_parent), ready)

    def _await_ready(self, c: _Copy) -> None:
        deadline = time.monotonic() + READY_TIMEOUT_S
        while not c.ready.exists():
            if c.proc.poll() is not None:
                raise RuntimeError(f"process {c.index} exited with {c.proc.returncode} before it was ready")
            if self.stop.is_set() or time.monotonic() > deadline:
                raise TimeoutError(f"process {c.index} not ready within {READY_TIMEOUT_S:.0f}s")
            self.stop.wait(0.05)  # bounded poll of another process's file
        c.info = json.loads(c.ready.read_text())

    def _watch(self) -> int:
        while not self.stop.wait(0.2):
            for k, c in enumerate(self.copies):
                if c.proc.poll() is None:
                    continue
                now = time.monotonic()
                self.restarts = [t for t in self.restarts if now - t < RESTART_WINDOW_S] + [now]
                if len(self.restarts) > MAX_RESTARTS:
                    log.error("%s: process %d exited with %s; too many restarts", self.name, k, c.proc.returncode)
                    return 1
                log.error("%s: process %d exited with %s; restarting it", self.name, k, c.proc.returncode)
                self.copies[k] = self._spawn(k)
                self._await_ready(self.copies[k])
                self._write_ready_file()
        return 0

    def _write_ready_file(self) -> None:
        for sock in self._reserved:  # every copy listens now: the ports are held by them
            sock.close()
        if not self.settings.ready_file:
            return
        payload = {
            "service": self.name,
            "id": self.base_id,
            "pid": os.getpid(),
            "zone": self.settings.zone,
            "grpc": f"{self.settings.host}:{self.grpc_port}",
            "grpc_port": self.grpc_port,
            "http_port": self.http_port,
            "http_scheme": "https" if self.settings.tls_cert else "http",
            "processes": [
                {"id": c.info.get("id"), "pid": c.proc.pid, "process_http_port": c.info.get("process_http_port")}
                | ({"plain_http_port": c.info["plain_http_port"]} if "plain_http_port" in c.info else {})
                for c in self.copies
            ],
        }
        write_ready_file(Path(self.settings.ready_file), payload)

    def _stop_all(self) -> None:
        for sock in self._reserved:
            sock.close()
        for c in self.copies:
            if c.proc.poll() is None:
                c.proc.send_signal(signal.SIGTERM)
        deadline = time.monotonic() + self.settings.grace_s + 5
        for c in self.copies:
            try:
                c.proc.wait(timeout=max(deadline - time.monotonic(), 0.1))
            except subprocess.TimeoutExpired:
                c.proc.kill()
                c.proc.wait(timeout=10)
        if self.settings.ready_file:
            with contextlib.suppress(OSError):
                Path(self.settings.ready_file).unlink()
        for f in self._dir.iterdir():
            f.unlink()
        self._dir.rmdir()
