"""`python -m kvmesh.bench worker --engine sim ...`: one JSON line of throughput and latency figures.

Modes:
- `--mode model` (default, `--engine sim` only): a discrete-event run of `SimEngineCore` under virtual
  time. Poisson arrivals at `--rate`, prompts of `--prompt-len` tokens whose first `--shared-prefix` tokens
  are shared within each of `--groups` groups, `--output-len` tokens out. Reports the *modelled* H200 figures
  (TTFT / ITL percentiles, token throughput, prefix hit rate, peak KV use, preemptions) and how fast the
  simulator itself runs (simulated seconds per wall second).
- `--mode service`: starts a real worker process (`--engine sim` at `--speed`, or `--engine vllm` with the
  tiny model) on 127.0.0.1 and drives it over gRPC with `--concurrency` streams; reports wall-clock figures.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from kvmesh.core.generation import EngineRequest, SamplingParams
from kvmesh.engine.sim.core import SimConfig, SimEngineCore


@dataclass
class Workload:
    prompts: list[tuple[int, ...]]
    arrivals: list[float]
    output_len: int


def make_workload(
    n: int, rate: float, prompt_len: int, shared: int, groups: int, output_len: int, seed: int
) -> Workload:
    rng = random.Random(seed)
    heads = [[rng.randrange(3, 120_000) for _ in range(shared)] for _ in range(max(1, groups))]
    prompts = []
    for _ in range(n):
        head = heads[rng.randrange(len(heads))]
        prompts.append(tuple(head + [rng.randrange(3, 120_000) for _ in range(prompt_len - shared)]))
    t, arrivals = 0.0, []
    for _ in range(n):
        t += rng.expovariate(rate) if rate > 0 else 0.0
        arrivals.append(t)
    return Workload(prompts, arrivals, output_len)


def pct(xs: list[float], q: float) -> float:
    """Nearest-rank percentile (q in [0, 100]); 0 for no data."""
    if not xs:
        return 0.0
    s = sorted(xs)
    return s[min(len(s) - 1, max(0, round(q / 100 * len(s) + 0.5) - 1))]


@dataclass
class Tally:
    ttft: list[float] = field(default_factory=list)
    itl: list[float] = field(default_factory=list)
    out_tokens: int = 0
    prompt_tokens: int = 0
    cached_tokens: int = 0
    done: int = 0
    rejected: int = 0


def run_model(w: Workload, cfg: SimConfig, max_steps: int = 5_000_000) -> dict[str, Any]:
    """Discrete-event run: arrivals enter at their time; each core step advances virtual time by its
    duration; outputs are stamped with the step's end (EngineOutput.time_s)."""
    core = SimEngineCore(cfg)
    tally = Tally()
    arrival: dict[str, float] = {}
    last: dict[str, float] = {}
    now, i, steps, peak_kv = 0.0, 0, 0, 0.0
    wall0 = time.perf_counter()
    n = len(w.prompts)
    while (i < n or core.has_work()) and steps < max_steps:
        while i < n and w.arrivals[i] <= now:
            rid = f"r{i}"
            try:
                core.add_request(
                    EngineRequest(rid, w.prompts[i], sampling=SamplingParams(max_tokens=w.output_len, ignore_eos=True)),
                    w.arrivals[i],
                )
                arrival[rid] = w.arrivals[i]
            except Exception:
                tally.rejected += 1
            i += 1
        if not core.has_work():
            now = w.arrivals[i]
            continue
        res = core.step(now)
        steps += 1
        now += res.duration_s
        peak_kv = max(peak_kv, core.pool.usage())
        for o in res.outputs:
            t = o.time_s if o.time_s is not None else now
            if o.token_ids:
                if o.request_id in last:
                    tally.itl.append(t - last[o.request_id])
                else:
                    tally.ttft.append(t - arrival[o.request_id])
                last[o.request_id] = t
                tally.out_tokens += len(o.token_ids)
            if o.finished and o.usage is not None:
                tally.done += 1
                tally.prompt_tokens += o.usage.prompt_tokens
                tally.cached_tokens += o.usage.cached_tokens
    wall = time.perf_counter() - wall0
    return {
        "requests": n,
        "completed": tally.done,
        "rejected": tally.rejected,
        "sim_seconds": round(now, 3),
        "output_tokens_per_s": round(tally.out_tokens / now, 1) if now else 0.0,
        "prompt_tokens_per_s": round(tally.prompt_tokens / now, 1) if now else 0.0,
        "ttft_p50_ms": round(pct(tally.ttft, 50) * 1e3, 2),
        "ttft_p99_ms": round(pct(tally.ttft, 99) * 1e3, 2),
        "itl_p50_ms": round(pct(tally.itl, 50) * 1e3, 2),
        "itl_p99_ms": round(pct(tally.itl, 99) * 1e3, 2),
        "prefix_hit_rate": round(tally.cached_tokens / tally.prompt_tokens, 4) if tally.prompt_tokens else 0.0,
        "peak_kv_usage": round(peak_kv, 4),
        "preemptions": core.preemptions_total,
        "evictions": core.pool.evictions,
        "steps": steps,
        "wall_s": round(wall, 3),
        "sim_speedup": round(now / wall, 1) if wall else 0.0,
    }


async def run_service(
    w: Workload, engine: str, speed: float, concurrency: int, block_size: int, max_model_len: int, kv_blocks: int
) -> dict[str, Any]:
    """Starts a real worker and drives it over gRPC; arrivals are ignored (closed loop, `concurrency`)."""
    import grpc

    from kvmesh.suite.launcher import start_service
    from kvmesh.v1 import common_pb2, worker_pb2, worker_pb2_grpc

    args = [
        "--engine",
        engine,
        "--block-size",
        str(block_size),
        "--max-model-len",
        str(max_model_len),
        "--sim-speed",
        str(speed),
        "--kv-blocks",
        str(kv_blocks),
        "--log-level",
        "WARNING",
    ]
    tmp = Path(tempfile.mkdtemp(prefix="kvmesh-bench-worker-"))
    sp = start_service("worker", tmp, *args, timeout=300 if engine == "vllm" else 60)
    tally = Tally()
    try:
        async with grpc.aio.insecure_channel(sp.address) as ch:
            stub = worker_pb2_grpc.WorkerServiceStub(ch)
            queue: asyncio.Queue[int] = asyncio.Queue()
            for k in range(len(w.prompts)):
                queue.put_nowait(k)

            async def client() -> None:
                while not queue.empty():
                    k = queue.get_nowait()
                    sampling = common_pb2.SamplingParams(max_tokens=w.output_len, ignore_eos=True, top_p=1.0)
                    ids = common_pb2.TokenIds(ids=list(w.prompts[k]))
                    req = worker_pb2.GenerateRequest(request_id=f"b{k}", token_ids=ids, sampling=sampling)
                    t0 = prev = time.perf_counter()
                    first = True
                    async for m in stub.Generate(req, timeout=600):
                        now = time.perf_counter()
                        if m.token_ids:
                            (tally.ttft if first else tally.itl).append(now - (t0 if first else prev))
                            first, prev = False, now
                            tally.out_tokens += len(m.token_ids)
                        if m.HasField("usage"):
                            tally.done += 1
                            tally.prompt_tokens += m.usage.prompt_tokens
                            tally.cached_tokens += m.usage.cached_tokens

            t0 = time.perf_counter()
            await asyncio.gather(*(client() for _ in range(concurrency)))
            wall = time.perf_counter() - t0
    finally:
        sp.terminate(timeout=60)
    return {
        "requests": len(w.prompts),
        "completed": tally.done,
        "wall_s": round(wall, 3),
        "output_tokens_per_s": round(tally.out_tokens / wall, 1),
        "requests_per_s": round(tally.done / wall, 2),
        "ttft_p50_ms": round(pct(tally.ttft, 50) * 1e3, 2),
        "ttft_p99_ms": round(pct(tally.ttft, 99) * 1e3, 2),
        "itl_p50_ms": round(pct(tally.itl, 50) * 1e3, 2),
        "itl_p99_ms": round(pct(tally.itl, 99) * 1e3, 2),
        "prefix_hit_rate": round(tally.cached_tokens / tally.prompt_tokens, 4) if tally.prompt_tokens else 0.0,
    }


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m kvmesh.bench worker", description=__doc__.splitlines()[0])
    ap.add_argument("--engine", choices=("sim", "vllm"), default="sim")
    ap.add_argument("--mode", choices=("model", "service"), default="model")
    ap.add_argument("--requests", type=int, default=500)
    ap.add_argument("--rate", type=float, default=4.0, help="arrivals per (simulated) second, model mode")
    ap.add_argument("--prompt-len", type=int, default=2048)
    ap.add_argument("--shared-prefix", type=int, default=1024)
    ap.add_argument("--groups", type=int, default=8)
    ap.add_argument("--output-len", type=int, default=128)
    ap.add_argument("--block-size", type=int, default=16)
    ap.add_argument("--kv-blocks", type=int, default=0, help="0: from the H200 memory budget")
    ap.add_argument("--max-model-len", type=int, default=131072)
    ap.add_argument("--concurrency", type=int, default=8, help="service mode: concurrent streams")
    ap.add_argument("--speed", type=float, default=0.0, help="service mode, sim: time speed-up (0 = instant)")
    ap.add_argument("--seed", type=int, default=0)
    a = ap.parse_args(argv)
    if a.shared_prefix > a.prompt_len:
        ap.error("--shared-prefix must be <= --prompt-len")
    w = make_workload(a.requests, a.rate, a.prompt_len, a.shared_prefix, a.groups, a.output_len, a.seed)
    params = {k: v for k, v in vars(a).items()}
    if a.mode == "model":
        if a.engine != "sim":
            ap.error("--mode model needs --engine sim")
        cfg = SimConfig(block_size=a.block_size, num_blocks=a.kv_blocks or None, max_model_len=a.max_model_len)
        result = run_model(w, cfg)
        params["kv_blocks"] = SimEngineCore(cfg).pool.num_blocks
    else:
        params["kv_blocks"] = a.kv_blocks or 4096
        result = asyncio.run(
            run_service(w, a.engine, a.speed, a.concurrency, a.block_size, a.max_model_len, params["kv_blocks"])
        )
    print(json.dumps({"bench": "worker", **params, **result}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
