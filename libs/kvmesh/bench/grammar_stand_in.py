"""Bench-only stand-in: a simulated worker that *accepts* a structured output and generates unconstrained.

    python -m kvmesh.bench.grammar_stand_in WORKER-FLAGS...      (started by `python -m kvmesh.bench router
                                                                  --response-format json`, never by a deployment)

The real simulated engine refuses a structured output with `InvalidArgument("structured_outputs")` (by design,
docs/engine-model.md: its tokens are synthetic and cannot follow a grammar). The router benchmark needs the
grammar to travel the whole path, client → router → worker, to price what the router does for it, while the
worker's time stays that of the instant engine. So this process is the normal worker
(`kvmesh.services.worker`, run as its own `__main__`) with `SimEngineCore.add_request` wrapped: a request's
structured output is validated as the real engine validates it (a bad schema is still a 400), logged once, and
dropped before the simulated engine sees it; the tokens are the usual synthetic ones, **not** constrained.
Every figure it gives is the router's and the wire's cost of carrying a grammar, not a grammar engine's.

Serving code never imports this (scripts/check_boundaries.py: tools are imported by nothing); it patches the
engine only inside the process it starts.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import runpy
import subprocess
import sys
import time
from pathlib import Path

from kvmesh.core.generation import EngineRequest
from kvmesh.core.sampling import check_structured_output
from kvmesh.engine.sim.core import SimEngineCore
from kvmesh.suite.launcher import ServiceProcess, wait_ready, wait_serving

WORKER_MODULE = "kvmesh.services.worker"  # run as __main__ in this process: the worker as deployed
ACCEPTED_LOG = "grammar stand-in: accepted a structured output"  # the bench's proof the grammar got here

log = logging.getLogger(__name__)


def install() -> None:
    """Wraps `SimEngineCore.add_request` in this process: structured outputs are checked, then dropped."""
    refuse = SimEngineCore.add_request
    seen = False

    def add_request(self: SimEngineCore, req: EngineRequest, now: float) -> None:
        nonlocal seen
        so = req.sampling.structured_output
        if so is not None:
            check_structured_output(so)  # what the real engine checks before it would refuse
            if not seen:
                seen = True
                log.warning("%s (%s); its tokens are NOT constrained (bench-only stand-in)", ACCEPTED_LOG, so.kind)
            req = dataclasses.replace(req, sampling=dataclasses.replace(req.sampling, structured_output=None))
        refuse(self, req, now)

    SimEngineCore.add_request = add_request  # type: ignore[method-assign]


_STARTS = 0


def start_stand_in_worker(tmp: Path, *args: str, timeout: float = 60.0) -> ServiceProcess:
    """Starts `python -m kvmesh.bench.grammar_stand_in --port 0 ... ARGS` as `kvmesh.suite.launcher.start_service`
    starts a worker (ready file, then a gRPC health check); returns it as a worker `ServiceProcess`."""
    global _STARTS
    _STARTS += 1
    tmp.mkdir(parents=True, exist_ok=True)
    ready = tmp / f"grammar-worker-{time.monotonic_ns()}-{_STARTS}.ready.json"
    log_path = ready.with_suffix(".log")
    cmd = [
        sys.executable,
        "-m",
        "kvmesh.bench.grammar_stand_in",
        "--port",
        "0",
        "--http-port",
        "0",
        "--ready-file",
        str(ready),
        *args,
    ]
    with open(log_path, "wb") as out:
        env = {**os.environ, "PYTHONUNBUFFERED": "1"}
        proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, env=env, start_new_session=True)
    sp = ServiceProcess("worker", proc, ready, log_path)
    wait_ready(sp, timeout)
    wait_serving(sp.address, timeout)
    return sp


def main() -> None:
    install()
    runpy.run_module(WORKER_MODULE, run_name="__main__", alter_sys=True)  # exits with the worker's status


if __name__ == "__main__":
    main()
