"""Router benchmarks; each prints one JSON line.

``python -m kvmesh.bench router --workers 16 --prompt-tokens 1024,8192,102400 --requests 2000 --concurrency 32``
starts W real worker processes with the simulated engine at ``--sim-speed 0`` (an instant engine: zero compute
time) and a real router process in front of them, all on 127.0.0.1, then for each prompt size measures
``c1_p50_ms`` / ``c1_p99_ms`` (one request at a time, ``max_tokens=1``, latency to the end of the stream) and
``c32_rps`` (``--concurrency`` requests in flight) through the router (``router.<P>.*``) and straight to the
workers round-robin (``direct.<P>.*``), plus ``overhead_p50_ms.<P>`` = router − direct at concurrency 1, and
``router.<P>.cpu_us_per_request``: the router process's CPU time (user + system, /proc) over the concurrency
run per request, and ``<path>.<P>.host_cpu_us_per_request``: the whole machine's busy CPU per request over the
path's concurrency run (`kvmesh.bench.process_cpu.host_busy_s`). On shared cores router ÷ direct requests/s
is about the inverse ratio of the two paths' host CPU per request.
``--router-processes N`` starts the router as ``kvmesh-router --processes N``; ``--router-cpu-cap C`` puts each
of its serving processes in a cgroup of its own capped at C cores (`kvmesh.bench.cpu_cap`: the routers are the
limit, as where they have their own cores; a copy the supervisor restarts mid-run is not capped);
``--router-connections K`` sets the gRPC client's connections per router process (default 1 for one process,
8 per process for several); ``--worker-transport frames`` sends the router's requests to the workers on generate
frames (opt-in, opaque to a service mesh) instead of the default gRPC ``GenerateStream``: the same run with each
shows what the fast path saves.
``--max-tokens N`` has every request generate N tokens (default 1). ``--logprobs K`` and ``--response-format
json|json_schema`` (gRPC and ``--api http``) also measure requests asking for log-probabilities or a structured
output as paths of their own in the same run, on the same workers, and add under ``features.<feature>.<P>`` what
each costs the router against the plain path: ``extra_ms_per_request`` / ``extra_us_per_token`` (c1 overhead)
and ``extra_cpu_us_per_request`` / ``extra_cpu_us_per_token`` (router CPU); with a structured output the
workers are bench-only stand-ins that accept the grammar without constraining (`kvmesh.bench.router_features`,
`kvmesh.bench.grammar_stand_in`).
The c1 samples of the two paths are taken in 4 interleaved rounds after a warm-up of both, so a slow spell of
the shared machine cannot land on one path only. Every request is a prefix-cache miss on both paths (one of
64 random token-id prompts with a per-request first token); the client is grpc.aio in this process.

``python -m kvmesh.bench router decision [--workers 16,256] [--iterations N]``:

``decision`` measures the routing decision on its own — the hot path of every request — with the default
profile (5 filters, cost + session-affinity scorers, min-cost picker) over W workers with varied load
reports, a quarter of them holding part of the prompt's prefix, a session id, and the router's in-flight
accounting (``apply`` + ``decide`` + ``assign``/``finish``). Per W it prints ``decide_us`` (decide alone) and
``decide_account_us`` (with the accounting) as p50/p99/mean in microseconds, and the baselines' ``decide_us``
p50 for comparison. One JSON line on stdout.
"""

from __future__ import annotations

import argparse
import json
import platform
import random
import sys
import time
from collections.abc import Sequence

from kvmesh.routing import InflightTracker, Profile, RoutingQuery, WorkerView

BLOCK = 16


def _views(n: int, rng: random.Random) -> list[WorkerView]:
    return [
        WorkerView(
            f"worker-{i}",
            zone="a",
            version="v1",
            running=rng.randrange(0, 32),
            waiting=rng.randrange(0, 8),
            max_queue=64,
            kv_usage=rng.random() * 0.8,
            kv_blocks_total=65536,
            prefill_tokens_queued=rng.randrange(0, 8192),
            decode_tokens_active=rng.randrange(0, 200_000),
            decode_latency_p50_ms=rng.uniform(10, 60),
            decode_latency_p95_ms=rng.uniform(60, 200),
            prefix_hit_rate=rng.random(),
        )
        for i in range(n)
    ]


def _pct(xs: list[float], q: float) -> float:
    s = sorted(xs)
    return s[min(int(q * len(s)), len(s) - 1)]


def _summary(ns: list[int]) -> dict[str, float]:
    us = [x / 1000 for x in ns]
    return {
        "p50": round(_pct(us, 0.5), 2),
        "p99": round(_pct(us, 0.99), 2),
        "mean": round(sum(us) / len(us), 2),
    }


def bench_decision(workers: int, iterations: int, seed: int = 0) -> dict[str, object]:
    """Time `iterations` decisions over `workers` workers; returns {decide_us, decide_account_us, baselines}."""
    rng = random.Random(seed)
    views = _views(workers, rng)
    profile = Profile.default(seed=seed)
    tracker = InflightTracker()
    prompt = 8192
    holders = rng.sample([v.id for v in views], max(workers // 4, 1))
    reqs = [
        RoutingQuery(
            f"req-{i}",
            prompt,
            matches={w: rng.randrange(1, prompt // BLOCK) for w in holders},
            block_size=BLOCK,
            session_id=f"session-{i % 97}",
        )
        for i in range(256)
    ]
    pc = time.perf_counter_ns
    for r in reqs[:64]:  # warm-up
        profile.decide(r, views)
    decide_ns: list[int] = []
    account_ns: list[int] = []
    outstanding: list[str] = []
    for i in range(iterations):
        r = reqs[i % len(reqs)]
        t0 = pc()
        profile.decide(r, views)
        decide_ns.append(pc() - t0)
        t0 = pc()
        tracker.apply(views)
        d = profile.decide(r, views)
        w = d.worker_id or views[0].id
        rid = f"{r.request_id}-{i}"
        tracker.assign(rid, w, prompt - r.overlap_tokens(w), prompt, BLOCK, float(i))
        outstanding.append(rid)
        if len(outstanding) > 64:
            tracker.finish(outstanding.pop(0))
        account_ns.append(pc() - t0)
    base: dict[str, float] = {}
    for name in ("round-robin", "random", "least-loaded"):
        bp = Profile.baseline(name, seed=seed)
        ns = []
        for i in range(min(iterations, 5000)):
            t0 = pc()
            bp.decide(reqs[i % len(reqs)], views)
            ns.append(pc() - t0)
        base[name] = _summary(ns)["p50"]
    return {"decide_us": _summary(decide_ns), "decide_account_us": _summary(account_ns), "baselines_p50_us": base}


def main(argv: Sequence[str] | None = None) -> int:
    args = list(sys.argv[1:] if argv is None else argv)
    if args and args[0] == "decision":
        dp = argparse.ArgumentParser(prog="python -m kvmesh.bench router decision")
        dp.add_argument("--workers", default="16,256", help="comma-separated worker counts")
        dp.add_argument("--iterations", type=int, default=20000)
        dp.add_argument("--seed", type=int, default=0)
        a = dp.parse_args(args[1:])
        out: dict[str, object] = {"bench": "router.decision", "python": platform.python_version()}
        for w in (int(x) for x in a.workers.split(",")):
            out[str(w)] = bench_decision(w, a.iterations, a.seed)
        print(json.dumps(out, sort_keys=True))
        return 0
    from kvmesh.bench.router_service import main as service_main

    return service_main(args)


if __name__ == "__main__":
    sys.exit(main())
