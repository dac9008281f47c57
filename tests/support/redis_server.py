"""A real `redis-server` for tests: free loopback port, private tmp dir, ready when PING answers.

Installs redis-server with `scripts/install_redis.sh` when it is missing. Readiness is a PING answered
(bounded by a deadline, each attempt a real connection); nothing sleeps to synchronise.
"""

from __future__ import annotations

import contextlib
import shutil
import subprocess
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import redis

from kvmesh.core.ports import free_port

REPO = Path(__file__).resolve().parents[2]


@dataclass
class RedisServer:
    """A started redis-server."""

    proc: subprocess.Popen[bytes]
    port: int
    log: Path

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"


def ensure_redis_installed() -> str:
    """Path of redis-server, installing it with the project script if needed."""
    path = shutil.which("redis-server")
    if path is None:
        subprocess.run(["bash", str(REPO / "scripts" / "install_redis.sh")], check=True, timeout=600)
        path = shutil.which("redis-server")
    if path is None:
        raise RuntimeError("redis-server is not installed and scripts/install_redis.sh did not install it")
    return path


def start_redis(tmp: Path, timeout_s: float = 20.0) -> RedisServer:
    """Start redis-server on a free port in `tmp` (3 attempts if a port race is lost)."""
    exe = ensure_redis_installed()
    tmp.mkdir(parents=True, exist_ok=True)
    last = ""
    for _attempt in range(3):
        port = free_port()
        log = tmp / f"redis-{port}.log"
        proc = subprocess.Popen(
            [
                exe,
                "--port",
                str(port),
                "--bind",
                "127.0.0.1",
                "--dir",
                str(tmp),
                "--save",
                "",
                "--appendonly",
                "no",
                "--logfile",
                str(log),
                "--daemonize",
                "no",
            ],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.STDOUT,
        )
        client = redis.Redis(host="127.0.0.1", port=port, socket_connect_timeout=0.5, socket_timeout=0.5)
        deadline = time.monotonic() + timeout_s
        try:
            while time.monotonic() < deadline and proc.poll() is None:
                try:
                    if client.ping():
                        return RedisServer(proc, port, log)
                except redis.ConnectionError:
                    proc_wait(proc, 0.05)  # wait on the process (returns early if it exits)
        finally:
            client.close()
        last = log.read_text(errors="replace") if log.exists() else ""
        stop_redis(RedisServer(proc, port, log))
    raise RuntimeError(f"redis-server did not answer PING: {last[-2000:]}")


def proc_wait(proc: subprocess.Popen[bytes], timeout: float) -> None:
    """Block up to `timeout` on the process exiting (a bounded wait between connection attempts)."""
    with contextlib.suppress(subprocess.TimeoutExpired):
        proc.wait(timeout=timeout)


def stop_redis(server: RedisServer) -> None:
    """Terminate (then kill) the server."""
    if server.proc.poll() is None:
        server.proc.terminate()
        try:
            server.proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            server.proc.kill()
            server.proc.wait(timeout=10)


def redis_server_fixture(tmp: Path) -> Iterator[RedisServer]:
    """Generator body for a pytest fixture."""
    srv = start_redis(tmp)
    try:
        yield srv
    finally:
        stop_redis(srv)
