"""``python -m kvmesh.bench fleet-live --trace PATH (--router ADDR | --local-workers W) --speed S ...``

Replays a trace against a running kvmesh router over gRPC (``kvmesh.fleet.live``) and prints one JSON line:
the client-side summary in simulated seconds. ``--local-workers W`` first starts a suite on loopback in a
temporary folder (a cache-manager, W simulated workers at ``--sim-speed S`` with the simulator's engine
settings, a router with the default routing profile) and also reports the CPU the suite used.
``--compare-sim`` runs the fleet simulator on the same slice, fleet size and policy (kvmesh) and adds its
summary and the live/sim agreement (``kvmesh.fleet.live.agreement``).

Suite settings that make it the simulator's fleet (``FleetConfig``): block size and KV blocks per worker equal
(``--kv-blocks`` default: the perf model's capacity at that block size), ``--max-model-len 131072`` and
``--max-queue 1024`` (the engine's defaults in the simulator), router admission queues wide open (the
simulator has none), the router's latency breaker out of the way (its thresholds are in wall ms, which the
speed-up shrinks), load reports every 50 ms wall.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import ipaddress
import json
import os
import sys
import tempfile
import time
from collections import Counter
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from kvmesh.bench.process_cpu import cpu_seconds
from kvmesh.engine.sim.perf import H200_LLAMA70B_FP8
from kvmesh.fleet.live import LiveConfig, agreement, replay
from kvmesh.fleet.policies import make_policy
from kvmesh.fleet.readers import read_trace
from kvmesh.fleet.sim import FleetConfig, run_policy
from kvmesh.fleet.trace import Trace
from kvmesh.suite.launcher import ServiceProcess, start_service

SUITE_MODEL = "sim-llama-3.1-70b-fp8"


@dataclass
class Suite:
    """A started local suite."""

    cache_manager: ServiceProcess
    workers: list[ServiceProcess]
    router: ServiceProcess

    @property
    def procs(self) -> list[ServiceProcess]:
        return [self.cache_manager, *self.workers, self.router]


@contextlib.contextmanager
def local_suite(
    tmp: Path,
    workers: int,
    speed: float,
    block_size: int = 512,
    kv_blocks: int | None = None,
    load_interval_ms: int = 50,
) -> Iterator[Suite]:
    """Starts cache-manager, ``workers`` sim workers and a router on loopback; stops them all on exit."""
    kv = kv_blocks if kv_blocks is not None else H200_LLAMA70B_FP8.kv_capacity_blocks(block_size)
    procs: list[ServiceProcess] = []
    try:
        cm = start_service(
            "cache-manager",
            tmp,
            "--block-size",
            str(block_size),
            "--model",
            SUITE_MODEL,
            "--checkpoint-interval-s",
            "0",
            "--warm-interval-s",
            "0",
            "--log-level",
            "WARNING",
        )
        procs.append(cm)
        ws = []
        for _ in range(workers):
            ws.append(
                start_service(
                    "worker",
                    tmp,
                    "--engine",
                    "sim",
                    "--sim-speed",
                    str(speed),
                    "--block-size",
                    str(block_size),
                    "--kv-blocks",
                    str(kv),
                    "--max-model-len",
                    "131072",
                    "--max-queue",
                    "1024",
                    "--cache-manager",
                    cm.address,
                    "--log-level",
                    "WARNING",
                )
            )
            procs.append(ws[-1])
        router = start_service(
            "router",
            tmp,
            "--workers",
            ",".join(w.address for w in ws),
            "--cache-manager",
            cm.address,
            "--salt-model",
            SUITE_MODEL,
            "--block-size",
            str(block_size),
            "--max-prompt-tokens",
            "131072",
            "--short-concurrency",
            "4096",
            "--long-concurrency",
            "4096",
            "--short-queue",
            "4096",
            "--long-queue",
            "4096",
            "--queue-timeout-s",
            "3600",
            "--breaker-p95-ms",
            "1e9",
            "--breaker-error-rate",
            "1.0",
            "--load-interval-ms",
            str(load_interval_ms),
            "--log-level",
            "WARNING",
        )
        procs.append(router)
        yield Suite(cm, ws, router)
    finally:
        for sp in reversed(procs):
            try:
                sp.terminate(timeout=15)
            except Exception:
                sp.kill()


def is_loopback(address: str) -> bool:
    """``host:port`` with host ``localhost``, ``127.*`` or ``[::1]``."""
    host = address.rsplit(":", 1)[0].strip("[]")
    try:
        return host == "localhost" or ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def select(trace: Trace, window: str, max_requests: int) -> Trace:
    """``window`` "T0:T1" (seconds) → ``trace.window``; then the first ``max_requests``."""
    if window:
        t0, t1 = (float(x) for x in window.split(":"))
        trace = trace.window(t0, t1)
    return trace.head(max_requests) if max_requests < len(trace) else trace


def simulate(trace: Trace, workers: int, block_size: int, kv_blocks: int | None, load_scale: float) -> dict[str, Any]:
    """The simulator's summary of ``trace`` on the same fleet under the kvmesh default profile."""
    cfg = FleetConfig(workers=workers, block_size=block_size, num_blocks=kv_blocks, load_scale=load_scale)
    res = run_policy(trace, make_policy("kvmesh"), cfg)
    return {**res.summary, "workers_used": dict(Counter(r.worker for r in res.records))}


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m kvmesh.bench fleet-live", description=__doc__.splitlines()[0])
    p.add_argument("--trace", required=True, help="Mooncake .jsonl or Azure .csv trace")
    where = p.add_mutually_exclusive_group(required=True)
    where.add_argument("--router", default="", help="gRPC address of a running router (host:port)")
    where.add_argument("--local-workers", type=int, default=0, help="start a local suite with W sim workers")
    p.add_argument("--speed", type=float, required=True, help="the workers' --sim-speed")
    p.add_argument("--load-scale", type=float, default=1.0, help="arrival rate multiplier (as the simulator's)")
    p.add_argument("--window", default="", help="T0:T1 seconds of the trace (re-based to 0)")
    p.add_argument("--max-requests", type=int, default=200)
    p.add_argument("--max-wall-s", type=float, default=120.0)
    p.add_argument("--block-size", type=int, default=512)
    p.add_argument("--kv-blocks", type=int, default=None, help="KV blocks per worker (default: perf model)")
    p.add_argument("--load-interval-ms", type=int, default=50, help="local suite: load-report interval (wall)")
    p.add_argument("--api-key", default="")
    p.add_argument(
        "--compare-sim", action="store_true", help="also run the simulator (needs --local-workers or --sim-workers)"
    )
    p.add_argument("--sim-workers", type=int, default=0, help="fleet size for --compare-sim with --router")
    return p


def _round(o: Any) -> Any:
    if isinstance(o, float):
        return round(o, 4)
    if isinstance(o, dict):
        return {k: _round(v) for k, v in o.items()}
    return o


def main(argv: Sequence[str]) -> int:
    a = _parser().parse_args(list(argv))
    workers = a.local_workers or a.sim_workers
    if a.compare_sim and not workers:
        print("--compare-sim needs --local-workers or --sim-workers", file=sys.stderr)
        return 2
    if a.router and not is_loopback(a.router):
        print(f"--router {a.router}: the live replay only targets loopback addresses", file=sys.stderr)
        return 2
    trace = select(read_trace(a.trace), a.window, a.max_requests)
    cfg = LiveConfig(speed=a.speed, load_scale=a.load_scale, max_wall_s=a.max_wall_s, api_key=a.api_key)
    line: dict[str, Any] = {
        "bench": "fleet-live",
        "trace": trace.name,
        "requests_sent": len(trace),
        "speed": a.speed,
        "load_scale": a.load_scale,
    }
    if a.router:
        live = asyncio.run(replay(trace, a.router, cfg))
    else:
        with (
            tempfile.TemporaryDirectory(prefix="kvmesh-fleet-live-") as tmp,
            local_suite(Path(tmp), a.local_workers, a.speed, a.block_size, a.kv_blocks, a.load_interval_ms) as suite,
        ):
            pids = [sp.proc.pid for sp in suite.procs]
            c0, t0, own0 = cpu_seconds(pids), time.monotonic(), time.process_time()
            live = asyncio.run(replay(trace, suite.router.address, cfg))
            wall = time.monotonic() - t0
            line["cpu"] = {
                "suite_cpu_s": cpu_seconds(pids) - c0,
                "client_cpu_s": time.process_time() - own0,
                "wall_s": wall,
                "cores": os.cpu_count(),
            }
    line["workers"] = workers or None
    line["live"] = live.summary
    if a.compare_sim:
        sim = simulate(trace, workers, a.block_size, a.kv_blocks, a.load_scale)
        line["sim"] = sim
        line["agreement"] = agreement(live.summary, sim)
    print(json.dumps(_round(line), sort_keys=True))
    return 0
