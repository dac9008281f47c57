"""``python -m kvmesh.bench pd``: prefill/decode disaggregation against aggregated serving, on the same load.

    python -m kvmesh.bench pd --engine vllm|sim [--streams 4] [--stream-tokens 96] [--long-prompts 6] ...

Starts two workers on loopback (real vLLM with the tiny model, each engine pinned to its own cores as in
`bench balance`, or simulated) and sends one client load twice, each phase under a tenant of its own (no
prefix-cache hit from the other phase, same greedy output): `--streams` requests of a short prompt decoding
`--stream-tokens` tokens each, and, while they decode, `--long-prompts` requests of `--long-tokens` prompt
tokens arriving every `--gap-ms`.

- aggregated: the workers as two aggregated workers, requests spread over them in turn (what a router does
  with equal workers);
- disaggregated: one prefill worker and one decode worker: each request's prefill half (`hand_off_ms`,
  `prefill_only`, `max_tokens` 1) on the first, its decode half (the same request with the prefill half's
  `KvHandoff`; a kv-sync handoff's `pull` as its `kv_pull`) on the second. The driver plays the router's P/D
  part itself, straight to the workers over gRPC (the engine-level halves): the router's decision is not
  measured, only what the split does to latencies.

One JSON line: per phase TTFT (every request, client side: sent to first token; a disaggregated request's
includes its prefill half) and ITL (the streams' gaps between tokens, while long prompts arrive) p50/p99, ms;
`outputs_equal` (every request's greedy tokens the same in both phases); `handoffs` (prefill halves that ended
with a usable handoff) and `fallbacks` (those that did not: their decode half computed the prompt).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import tempfile
import time
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import grpc

from kvmesh.bench.balance import percentile
from kvmesh.core.modelfiles import resolve_model_dir
from kvmesh.suite.launcher import ServiceProcess, start_service, vllm_core_env
from kvmesh.v1 import common_pb2, worker_pb2, worker_pb2_grpc

BLOCK_SIZE = 32
TOKEN_LOW, TOKEN_HIGH = 200, 1000  # the tiny model's clean-text ids (vocabulary 1024), valid for the sim too
AGGREGATED, DISAGGREGATED = "aggregated", "disaggregated"


@dataclass(frozen=True)
class PdSetup:
    """What `run_pd` starts and sends."""

    engine: str = "vllm"  # "vllm" or "sim"
    streams: int = 4
    stream_prompt_tokens: int = 64
    stream_tokens: int = 96
    long_prompts: int = 6
    long_tokens: int = 1536
    long_max_tokens: int = 4
    gap_ms: float = 400.0
    hold_ms: int = 10_000
    seed: int = 0


@dataclass(frozen=True)
class Job:
    """One request of the load: `start_s` after the phase's start; `stream` requests' gaps are the ITL."""

    name: str
    prompt: tuple[int, ...]
    max_tokens: int
    start_s: float
    stream: bool


@dataclass
class Result:
    stream: bool
    tokens: list[int] = field(default_factory=list)
    ttft_ms: float = 0.0
    gaps_ms: list[float] = field(default_factory=list)
    handoff: str = ""  # a disaggregated request's handoff kind: "engine", "pull" or "" (none: computed)


def load(setup: PdSetup) -> list[Job]:
    """The streams first, then the long prompts arriving while they decode."""
    rng = random.Random(setup.seed)

    def prompt(first: int, n: int) -> tuple[int, ...]:
        return (first, *(rng.randrange(TOKEN_LOW, TOKEN_HIGH) for _ in range(n - 1)))

    jobs = [
        Job(f"s{i}", prompt(TOKEN_LOW + i, setup.stream_prompt_tokens), setup.stream_tokens, 0.0, True)
        for i in range(setup.streams)
    ]
    first_long = 0.5  # the streams are decoding by then
    jobs += [
        Job(
            f"l{i}",
            prompt(TOKEN_LOW + 100 + i, setup.long_tokens),
            setup.long_max_tokens,
            first_long + i * setup.gap_ms / 1000,
            False,
        )
        for i in range(setup.long_prompts)
    ]
    return jobs


def _sampling(max_tokens: int) -> common_pb2.SamplingParams:
    return common_pb2.SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True)


async def _stream(
    stub: worker_pb2_grpc.WorkerServiceStub, req: worker_pb2.GenerateRequest, t0: float, res: Result
) -> None:
    """The decode stream of `req`: tokens, TTFT from `t0`, gaps between token messages (per token)."""
    last: float | None = None
    async for msg in stub.Generate(req, timeout=600):
        if not msg.token_ids:
            continue
        now = time.perf_counter()
        if last is None:
            res.ttft_ms = 1000 * (now - t0)
        else:
            res.gaps_ms += [1000 * (now - last) / len(msg.token_ids)] * len(msg.token_ids)
        last = now
        res.tokens += list(msg.token_ids)


async def run_phase(
    mode: str, workers: Sequence[str], jobs: Sequence[Job], setup: PdSetup, tenant: str
) -> dict[str, Result]:
    """Sends `jobs` at their times; aggregated over `workers` in turn, disaggregated prefill on the first and
    decode on the second."""
    channels = [grpc.aio.insecure_channel(a) for a in workers]
    stubs = [worker_pb2_grpc.WorkerServiceStub(c) for c in channels]
    results: dict[str, Result] = {}

    async def one(i: int, job: Job, phase_t0: float) -> None:
        await asyncio.sleep(max(0.0, phase_t0 + job.start_s - time.perf_counter()))
        res = results[job.name] = Result(job.stream)
        rid = f"{tenant}-{job.name}"
        ids = common_pb2.TokenIds(ids=job.prompt)
        t0 = time.perf_counter()
        if mode == AGGREGATED:
            req = worker_pb2.GenerateRequest(
                request_id=rid, token_ids=ids, sampling=_sampling(job.max_tokens), tenant=tenant
            )
            await _stream(stubs[i % len(stubs)], req, t0, res)
            return
        prefill = worker_pb2.GenerateRequest(
            request_id=f"{rid}-p",
            token_ids=ids,
            sampling=_sampling(1),
            tenant=tenant,
            prefill_only=True,
            hand_off_ms=setup.hold_ms,
        )
        handoff: worker_pb2.KvHandoff | None = None
        async for msg in stubs[0].Generate(prefill, timeout=600):
            if msg.HasField("handoff"):
                handoff = msg.handoff
        decode = worker_pb2.GenerateRequest(
            request_id=rid, token_ids=ids, sampling=_sampling(job.max_tokens), tenant=tenant
        )
        if handoff is not None and (handoff.engine_params_json or handoff.HasField("pull")):
            decode.handoff.CopyFrom(handoff)
            if handoff.HasField("pull"):
                decode.kv_pull.CopyFrom(handoff.pull)
            res.handoff = "engine" if handoff.engine_params_json else "pull"
        await _stream(stubs[1], decode, t0, res)

    try:
        phase_t0 = time.perf_counter()
        await asyncio.gather(*(one(i, j, phase_t0) for i, j in enumerate(jobs)))
    finally:
        for c in channels:
            await c.close()
    return results


def summary(results: dict[str, Result]) -> dict[str, Any]:
    ttft = [r.ttft_ms for r in results.values()]
    gaps = [g for r in results.values() if r.stream for g in r.gaps_ms]
    return {
        "ttft_ms": {"p50": round(percentile(ttft, 0.5), 1), "p99": round(percentile(ttft, 0.99), 1)},
        "itl_ms": {"p50": round(percentile(gaps, 0.5), 1), "p99": round(percentile(gaps, 0.99), 1)},
    }


def _worker_args(setup: PdSetup) -> tuple[list[str], list[dict[str, str]], float]:
    """The workers' flags, each one's environment, the start timeout."""
    if setup.engine == "sim":
        return ["--engine", "sim", "--block-size", str(BLOCK_SIZE), "--kv-blocks", "4096"], [{}, {}], 60.0
    model = resolve_model_dir("")
    if model is None:
        raise SystemExit("the vllm engine needs the tiny model: run scripts/build_tiny_model.py")
    args = ["--engine", "vllm", "--model", str(model), "--block-size", str(BLOCK_SIZE), "--max-model-len", "2048"]
    args += ["--vllm-dtype", "bfloat16", "--handoff-hold-ms", str(setup.hold_ms)]
    env = {"VLLM_CPU_KVCACHE_SPACE": "1", "HF_HUB_OFFLINE": "1"}
    return args, [{**env, **e} for e in vllm_core_env(2, pinned=True)], 600.0


def start_workers(setup: PdSetup, tmp: Path) -> list[ServiceProcess]:
    """Two workers of role `both` (a worker runs either half, and aggregated requests), started in parallel."""
    args, envs, timeout = _worker_args(setup)
    procs: list[ServiceProcess] = []
    with ThreadPoolExecutor(2) as ex:
        futs = [
            ex.submit(start_service, "worker", tmp / f"w{i}", *args, env=envs[i], timeout=timeout) for i in range(2)
        ]
        for f in futs:
            try:
                procs.append(f.result())
            except Exception:
                for p in procs:
                    p.kill()
                raise
    return procs


async def measure(addresses: Sequence[str], setup: PdSetup) -> dict[str, Any]:
    """A warm-up of each phase (kernels' first runs, NIXL's handshake), then both phases on the same load."""
    jobs = load(setup)
    warm = [Job(f"w{j.name}", j.prompt[::-1], 4, 0.0, j.stream) for j in jobs[:: max(1, len(jobs) // 4)]]
    await run_phase(AGGREGATED, addresses, warm, setup, "warm-a")
    await run_phase(DISAGGREGATED, addresses, warm, setup, "warm-d")
    agg = await run_phase(AGGREGATED, addresses, jobs, setup, "agg")
    dis = await run_phase(DISAGGREGATED, addresses, jobs, setup, "dis")
    handoffs = sum(1 for r in dis.values() if r.handoff)
    return {
        "engine": setup.engine,
        AGGREGATED: summary(agg),
        DISAGGREGATED: summary(dis),
        "outputs_equal": all(agg[j.name].tokens == dis[j.name].tokens for j in jobs),
        "handoffs": handoffs,
        "handoff_kinds": sorted({r.handoff for r in dis.values() if r.handoff}),
        "fallbacks": len(dis) - handoffs,
        "requests": len(jobs),
    }


def run_pd(setup: PdSetup) -> dict[str, Any]:
    with tempfile.TemporaryDirectory(prefix="kvmesh-bench-pd-") as tmp:
        procs = start_workers(setup, Path(tmp))
        try:
            return asyncio.run(measure([p.address for p in procs], setup))
        finally:
            for p in procs:
                try:
                    p.terminate(timeout=30)
                except Exception:
                    p.kill()


def main(argv: Sequence[str]) -> int:
    ap = argparse.ArgumentParser(prog="python -m kvmesh.bench pd")
    d = PdSetup()
    ap.add_argument("--engine", choices=("vllm", "sim"), default=d.engine)
    ap.add_argument("--streams", type=int, default=d.streams, help="requests decoding while long prompts arrive")
    ap.add_argument("--stream-prompt-tokens", type=int, default=d.stream_prompt_tokens)
    ap.add_argument("--stream-tokens", type=int, default=d.stream_tokens, help="tokens each stream decodes")
    ap.add_argument("--long-prompts", type=int, default=d.long_prompts)
    ap.add_argument("--long-tokens", type=int, default=d.long_tokens, help="prompt tokens of a long prompt")
    ap.add_argument("--long-max-tokens", type=int, default=d.long_max_tokens)
    ap.add_argument("--gap-ms", type=float, default=d.gap_ms, help="between two long prompts' arrivals")
    ap.add_argument("--hold-ms", type=int, default=d.hold_ms, help="a prefill half's hold")
    ap.add_argument("--seed", type=int, default=d.seed)
    a = ap.parse_args(list(argv))
    for name in ("streams", "stream_prompt_tokens", "stream_tokens", "long_tokens", "long_max_tokens", "hold_ms"):
        if getattr(a, name) < 1:
            ap.error(f"--{name.replace('_', '-')} must be at least 1")
    setup = PdSetup(
        a.engine,
        a.streams,
        a.stream_prompt_tokens,
        a.stream_tokens,
        a.long_prompts,
        a.long_tokens,
        a.long_max_tokens,
        a.gap_ms,
        a.hold_ms,
        a.seed,
    )
    print(json.dumps(run_pd(setup)))
    return 0
