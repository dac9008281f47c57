"""Real service processes for tests (see kvmesh.suite.launcher): port 0, readiness without sleeps."""

import contextlib
import os
import signal
import subprocess
from collections.abc import Callable

from kvmesh.suite.launcher import SERVICES, ServiceProcess, start_service, wait_ready, wait_serving
from kvmesh.suite.local import _start_together

__all__ = [
    "SERVICES",
    "ServiceProcess",
    "start_service",
    "start_together",
    "stop_process_group",
    "wait_ready",
    "wait_serving",
]


def start_together(*starts: Callable[[], ServiceProcess]) -> list[ServiceProcess]:
    """Independent service starts at once, by `kvmesh up`'s own helper (`kvmesh.suite.local`): what each
    started, in the order given; if one fails, the others' processes are killed and its error raised. A start
    is mostly the new process importing its modules on one core: one after another, they leave CI's second
    core idle. A start that needs another's address is not independent of it: start that one first."""
    return _start_together(starts)


def stop_process_group(proc: "subprocess.Popen[bytes]", timeout: float = 30.0) -> None:
    """SIGTERM the process group `proc` leads (started with ``start_new_session=True``, e.g. a vLLM server
    and its engine processes), wait (bounded), then SIGKILL it."""
    with contextlib.suppress(ProcessLookupError):
        os.killpg(proc.pid, signal.SIGTERM)
    try:
        proc.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(timeout=10)
