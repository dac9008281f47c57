"""``python -m kvmesh.bench balance``: how the router splits distinct prompts over its workers.

Starts W workers (simulated or real vLLM with the tiny model) and a router on loopback, sends `--prompts`
distinct random prompts of `--prompt-tokens` tokens (no shared blocks) over gRPC at `--concurrency`, and
prints one JSON line: requests per worker, the largest worker's share, client-side TTFT p50/p99/max, and
per worker its requests' p50 time and the mean number of requests it held at once.

Before the measured prompts, each worker gets `--warmup` rounds of `--concurrency` distinct prompts of the
same length straight to its own gRPC port (their first token is outside the measured prompts' range, so no
block is shared): a fresh vLLM engine's first batches of each shape run its kernels' one-time set-up, which
made one worker of a pair 2× slower for the first dozens of requests, and a load-aware router rightly sends
a slower worker fewer. The measurement is of the router over equal, warm workers.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import tempfile
import time
from collections import Counter
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import grpc

from kvmesh.core.modelfiles import resolve_model_dir
from kvmesh.suite.launcher import ServiceProcess, start_service, vllm_core_env
from kvmesh.v1 import common_pb2, router_pb2, router_pb2_grpc, worker_pb2, worker_pb2_grpc

BLOCK_SIZE = 32
VOCAB_LOW, VOCAB_HIGH = 3, 1000  # ids valid for the tiny model (vocabulary 1024) and the sim engine


@dataclass(frozen=True)
class BalanceSetup:
    """What `run_balance` starts and sends."""

    engine: str = "vllm"  # "vllm" or "sim"
    workers: int = 2
    prompts: int = 64
    prompt_tokens: int = 512
    concurrency: int = 8
    max_tokens: int = 16
    seed: int = 0
    warmup: int = 2  # rounds of `concurrency` prompts sent to each worker directly before measuring
    # vLLM engines' cores: "own" (each worker's whole process, its engine's OpenMP threads included, pinned
    # to disjoint cores: `kvmesh.core.cpus`) or "shared" (unpinned, cores / workers
    # threads each: the OS shares every core between the engines, the router, the client and the frontends)
    cores: str = "own"


def distinct_prompts(n: int, tokens: int, seed: int) -> list[list[int]]:
    """`n` random prompts; each starts with its own index so no two share even their first block."""
    rng = random.Random(seed)
    return [[VOCAB_LOW + i] + [rng.randrange(VOCAB_LOW, VOCAB_HIGH) for _ in range(tokens - 1)] for i in range(n)]


def warmup_prompts(n: int, tokens: int, seed: int) -> list[list[int]]:
    """`n` random prompts whose first token (VOCAB_HIGH + i) no measured prompt starts with."""
    return [[VOCAB_HIGH + i, *p[1:]] for i, p in enumerate(distinct_prompts(n, tokens, seed + 1))]


async def warm_up(workers: Sequence[ServiceProcess], setup: BalanceSetup) -> None:
    """`setup.warmup` rounds of `setup.concurrency` concurrent prompts on each worker, straight to it."""
    sampling = common_pb2.SamplingParams(max_tokens=setup.max_tokens, ignore_eos=True)
    prompts = warmup_prompts(setup.concurrency, setup.prompt_tokens, setup.seed)

    async def one(stub: worker_pb2_grpc.WorkerServiceStub, rid: str, ids: list[int]) -> None:
        req = worker_pb2.GenerateRequest(request_id=rid, token_ids=common_pb2.TokenIds(ids=ids), sampling=sampling)
        async for _ in stub.Generate(req, timeout=300):
            pass

    for r in range(setup.warmup):
        for w in workers:
            async with grpc.aio.insecure_channel(w.address) as ch:
                stub = worker_pb2_grpc.WorkerServiceStub(ch)
                await asyncio.gather(*(one(stub, f"warmup-{r}-{i}", p) for i, p in enumerate(prompts)))


def percentile(xs: Sequence[float], q: float) -> float:
    """The nearest-rank q-quantile of `xs` (non-empty)."""
    s = sorted(xs)
    return s[min(int(q * len(s)), len(s) - 1)]


def _worker_args(setup: BalanceSetup) -> tuple[list[str], dict[str, str], float]:
    if setup.engine == "sim":
        return ["--engine", "sim", "--block-size", str(BLOCK_SIZE), "--kv-blocks", "4096"], {}, 60.0
    model = resolve_model_dir("")
    if model is None:
        raise SystemExit("the vllm engine needs the tiny model: run scripts/build_tiny_model.py")
    args = ["--engine", "vllm", "--model", str(model), "--block-size", str(BLOCK_SIZE), "--max-model-len", "2048"]
    return args, {"VLLM_CPU_KVCACHE_SPACE": "1", "HF_HUB_OFFLINE": "1"}, 600.0


def start_suite(setup: BalanceSetup, tmp: Path) -> list[ServiceProcess]:
    """The workers (started in parallel: vLLM takes a while; each vLLM engine on its own cores) then the
    router; the router is last."""
    args, env, timeout = _worker_args(setup)
    if setup.engine == "vllm":
        envs = [{**env, **e} for e in vllm_core_env(setup.workers, pinned=setup.cores == "own")]
    else:
        envs = [env] * setup.workers
    procs: list[ServiceProcess] = []
    with ThreadPoolExecutor(setup.workers) as ex:
        futs = [
            ex.submit(start_service, "worker", tmp / f"w{i}", *args, env=envs[i], timeout=timeout)
            for i in range(setup.workers)
        ]
        for f in futs:
            try:
                procs.append(f.result())
            except Exception:
                for p in procs:
                    p.kill()
                raise
    model = ["--model", str(resolve_model_dir(""))] if setup.engine == "vllm" else []
    addrs = ",".join(w.address for w in procs)
    procs.append(start_service("router", tmp / "r", "--workers", addrs, "--block-size", str(BLOCK_SIZE), *model))
    return procs


async def send_all(router_address: str, setup: BalanceSetup) -> dict[str, Any]:
    """Sends the prompts at `setup.concurrency`; returns the split and TTFT figures (ms)."""
    prompts = distinct_prompts(setup.prompts, setup.prompt_tokens, setup.seed)
    sampling = common_pb2.SamplingParams(max_tokens=setup.max_tokens, ignore_eos=True)
    split: Counter[str] = Counter()
    ttft: list[float] = []
    took: dict[str, list[float]] = {}  # per worker: whole request times, ms (a slower worker should get fewer)
    queue: asyncio.Queue[list[int]] = asyncio.Queue()
    for p in prompts:
        queue.put_nowait(p)
    async with grpc.aio.insecure_channel(router_address) as ch:
        stub = router_pb2_grpc.RouterServiceStub(ch)

        async def one(ids: list[int]) -> None:
            req = router_pb2.RouterServiceGenerateRequest(token_ids=common_pb2.TokenIds(ids=ids), sampling=sampling)
            t0 = time.perf_counter()
            first: float | None = None
            worker = ""
            async for m in stub.Generate(req, timeout=300):
                worker = worker or m.worker_id
                if first is None and m.token_ids:
                    first = time.perf_counter() - t0
            split[worker] += 1
            took.setdefault(worker, []).append(1000.0 * (time.perf_counter() - t0))
            ttft.append(1000.0 * (first if first is not None else time.perf_counter() - t0))

        async def lane() -> None:
            while not queue.empty():
                await one(queue.get_nowait())

        wall0 = time.perf_counter()
        await asyncio.gather(*(lane() for _ in range(setup.concurrency)))
        wall_ms = 1000.0 * (time.perf_counter() - wall0)
    return {
        "engine": setup.engine,
        "requests": setup.prompts,
        "prompt_tokens": setup.prompt_tokens,
        "concurrency": setup.concurrency,
        "split": dict(sorted(split.items())),
        "max_share": round(max(split.values()) / setup.prompts, 3),
        "ttft_p50_ms": round(percentile(ttft, 0.50), 1),
        "ttft_p99_ms": round(percentile(ttft, 0.99), 1),
        "ttft_max_ms": round(max(ttft), 1),
        "request_p50_ms": {w: round(percentile(v, 0.50), 1) for w, v in sorted(took.items())},
        # Little's law: a worker's requests' summed durations over the run's wall time is the mean number
        # of requests it held at once; a router that balances load equalises these, whatever each is worth
        "mean_outstanding": {w: round(sum(v) / wall_ms, 2) for w, v in sorted(took.items())},
    }


def run_balance(setup: BalanceSetup) -> dict[str, Any]:
    """Starts the suite, sends the prompts, stops the suite; returns `send_all`'s figures."""
    with tempfile.TemporaryDirectory(prefix="kvmesh-bench-balance-") as tmp:
        procs = start_suite(setup, Path(tmp))
        try:
            asyncio.run(warm_up(procs[:-1], setup))
            return asyncio.run(send_all(procs[-1].address, setup))
        finally:
            for p in reversed(procs):
                try:
                    p.terminate(timeout=30)
                except Exception:
                    p.kill()


def main(argv: Sequence[str]) -> int:
    ap = argparse.ArgumentParser(prog="python -m kvmesh.bench balance")
    ap.add_argument("--engine", choices=("vllm", "sim"), default="vllm")
    ap.add_argument("--workers", type=int, default=2)
    ap.add_argument("--prompts", type=int, default=64)
    ap.add_argument("--prompt-tokens", type=int, default=512)
    ap.add_argument("--concurrency", type=int, default=8)
    ap.add_argument("--max-tokens", type=int, default=16)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--warmup", type=int, default=2, help="rounds of --concurrency prompts per worker, unmeasured")
    ap.add_argument("--cores", choices=("own", "shared"), default="own", help="vLLM engines' cores (BalanceSetup)")
    a = ap.parse_args(list(argv))
    setup = BalanceSetup(
        a.engine, a.workers, a.prompts, a.prompt_tokens, a.concurrency, a.max_tokens, a.seed, a.warmup, a.cores
    )
    print(json.dumps(run_balance(setup)))
    return 0
