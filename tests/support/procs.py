"""Real service processes for tests (see kvmesh.suite.launcher): port 0, readiness without sleeps."""

import contextlib
import os
import signal
import subprocess

from kvmesh.suite.launcher import SERVICES, ServiceProcess, start_service, wait_ready, wait_serving

__all__ = ["SERVICES", "ServiceProcess", "start_service", "stop_process_group", "wait_ready", "wait_serving"]


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
