"""Service processes: check ports are free, start (on given ports, or 0: a free one), wait for readiness
(ready file + gRPC health), stop.

Used by `kvmesh up` and by the tests.

Readiness is event-driven: the service writes its ready file only once it serves, and we then confirm with
a `grpc.health.v1` check. Every wait is bounded by a deadline; nothing sleeps to synchronise.
"""

from __future__ import annotations

import contextlib
import itertools
import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from kvmesh.core.cpus import core_shares
from kvmesh.suite.shm_leftovers import mapped_by_group, unlink_unmapped

SERVICES = {
    "router": "kvmesh.services.router",
    "worker": "kvmesh.services.worker",
    "cache-manager": "kvmesh.services.cache_manager",
    "failover": "kvmesh.services.failover",
    "planner": "kvmesh.services.planner",
}


@dataclass
class ServiceProcess:
    """A started service process and where it listens."""

    name: str
    proc: subprocess.Popen[bytes]
    ready_file: Path
    log_path: Path
    info: dict[str, Any] = field(default_factory=dict)

    @property
    def address(self) -> str:
        return str(self.info["grpc"])

    @property
    def http_port(self) -> int:
        return int(self.info["http_port"])

    def log(self) -> str:
        return self.log_path.read_text(errors="replace") if self.log_path.exists() else ""

    def terminate(self, timeout: float = 30.0) -> int:
        """SIGTERM and wait; returns the exit code (kills after `timeout`). Leftover children (e.g. vLLM's
        engine-core process) are killed with the process group."""
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
        try:
            return self.proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            self.kill()
            raise
        finally:
            self._kill_group()

    def kill(self) -> None:
        """SIGKILL (kill -9) of the service and every process of its group (it runs in its own session), as a
        machine or container dying would: no orphaned engine process survives it."""
        self._kill_group()
        self.proc.wait(timeout=10)

    def _kill_group(self) -> None:
        """SIGKILL the group, then remove the shared memory it leaves that nothing maps any more."""
        segments = mapped_by_group(self.proc.pid)
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(self.proc.pid, signal.SIGKILL)
        if segments:
            with contextlib.suppress(subprocess.TimeoutExpired):
                self.proc.wait(timeout=10)  # the leader's mappings end with it (the rest die with the signal)
            unlink_unmapped(segments)


def vllm_core_env(n: int, pinned: bool = True) -> list[dict[str, str]]:
    """The environment of each of `n` vLLM workers started on this host: each engine pinned to its own cores,
    or (`pinned=False`) unpinned with an equal share of the cores as its thread count, so that the OS
    scheduler shares every core fairly between the engines and whatever else runs on the host."""
    cpus = sorted(os.sched_getaffinity(0))
    if pinned:  # the engine's OpenMP threads, and the whole worker process (`kvmesh.core.cpus`)
        return [{"VLLM_CPU_OMP_THREADS_BIND": c, "KVMESH_WORKER_CPU_AFFINITY": c} for c in core_shares(cpus, n)]
    threads = str(max(1, len(cpus) // max(n, 1)))
    return [{"VLLM_CPU_OMP_THREADS_BIND": "nobind", "OMP_NUM_THREADS": threads}] * n


_STARTS = itertools.count()  # with the clock, a unique ready-file name when threads start services together


class StartWatch(Protocol):
    """Told of each service `start_service` starts: once its process exists (`args`: its flags), and once it
    serves (`sp.info` then holds its ready file); and by `kvmesh.suite.local.start` of the suite's credentials
    (`SuiteAuth.state`) once provisioned. `kvmesh up` records and prints them (`kvmesh.suite.runs`)."""

    def provisioned(self, auth: dict[str, Any]) -> None: ...

    def spawned(self, sp: ServiceProcess, args: Sequence[str]) -> None: ...

    def ready(self, sp: ServiceProcess) -> None: ...


def start_service(
    name: str,
    tmp: Path,
    *args: str,
    env: dict[str, str] | None = None,
    timeout: float = 60.0,
    wait_healthy: bool = True,
    port: int = 0,
    http_port: int = 0,
    credentials: grpc.ChannelCredentials | None = None,
    watch: StartWatch | None = None,
) -> ServiceProcess:
    """Starts `python -m <service> --port P --http-port H --ready-file ...` and waits until it serves (its
    health checked over TLS with `credentials` when given); `watch` is told when it exists and when it serves."""
    tmp.mkdir(parents=True, exist_ok=True)
    ready = tmp / f"{name}-{time.monotonic_ns()}-{next(_STARTS)}.ready.json"
    log_path = ready.with_suffix(".log")
    full_env = {**os.environ, "PYTHONUNBUFFERED": "1", **(env or {})}
    cmd = [
        sys.executable,
        "-m",
        SERVICES[name],
        "--port",
        str(port),
        "--http-port",
        str(http_port),
        "--ready-file",
        str(ready),
        *args,
    ]
    with open(log_path, "wb") as log:
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=full_env, start_new_session=True)
    sp = ServiceProcess(name, proc, ready, log_path)
    if watch is not None:
        watch.spawned(sp, args)
    wait_ready(sp, timeout)
    if wait_healthy:
        wait_serving(sp.address, timeout, credentials=credentials)
    if watch is not None:
        watch.ready(sp)
    return sp


def wait_ready(sp: ServiceProcess, timeout: float) -> None:
    """Waits for the ready file (inotify-free: a bounded poll of the file system, not of the service's state)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if sp.proc.poll() is not None:
            raise RuntimeError(f"{sp.name} exited with {sp.proc.returncode}:\n{sp.log()[-4000:]}")
        if sp.ready_file.exists():
            sp.info = json.loads(sp.ready_file.read_text())
            return
        time.sleep(0.02)
    sp.kill()
    raise TimeoutError(f"{sp.name} not ready within {timeout}s:\n{sp.log()[-4000:]}")


def wait_serving(
    address: str, timeout: float, service: str = "", credentials: grpc.ChannelCredentials | None = None
) -> None:
    """Blocks until grpc.health.v1 reports SERVING (wait_for_ready, bounded by `timeout`)."""
    channel = grpc.secure_channel(address, credentials) if credentials else grpc.insecure_channel(address)
    with channel:
        stub = health_pb2_grpc.HealthStub(channel)
        reply = stub.Check(health_pb2.HealthCheckRequest(service=service), timeout=timeout, wait_for_ready=True)
        if reply.status != health_pb2.HealthCheckResponse.SERVING:
            raise RuntimeError(f"{address} is {reply.status}")
