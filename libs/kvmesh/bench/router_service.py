"""The router service benchmark (see `kvmesh.bench.router`): real worker + router processes on loopback."""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import subprocess
import tempfile
from collections.abc import Awaitable, Callable, Sequence
from functools import partial
from pathlib import Path
from typing import Any

import aiohttp
import grpc

from kvmesh.bench.cpu_cap import CpuCapError, CpuCaps
from kvmesh.bench.grammar_stand_in import ACCEPTED_LOG, start_stand_in_worker
from kvmesh.bench.router_compare import measure, run_http, start_third_party, wait_http
from kvmesh.bench.router_features import (
    RESPONSE_FORMATS,
    STAND_IN,
    Feature,
    FeatureCheckError,
    c1_rounds,
    check_grpc,
    check_http,
    features_from_flags,
    split_features,
)
from kvmesh.core.modelfiles import resolve_model_dir
from kvmesh.core.ports import free_port
from kvmesh.core.sampling import LOGPROBS_MAX
from kvmesh.engine.tokenizer import HfTokenizer
from kvmesh.suite.launcher import ServiceProcess, start_service
from kvmesh.v1 import common_pb2, router_pb2, worker_pb2
from kvmesh.wire.protowire import length_delimited

DISTINCT = 64
OPTS = [("grpc.max_send_message_length", 64 << 20), ("grpc.max_receive_message_length", 64 << 20)]
UNIQUE_BASE = 30_000  # prompts' other tokens are < 30000: the unique first token never collides with them


async def _drain(call: Any) -> None:
    async for _ in call:
        pass


class UniquePrompts:
    """Every request a cache miss, on both paths: request k's prompt is one of `DISTINCT` random prompts with
    its first token replaced by a per-request value, so its whole block-hash chain is new. (Reusing prompts
    verbatim made the comparison unfair: direct round-robin sends prompt i to worker i mod W, whose simulated
    prefix cache then always hits, while the router, without a cache-manager here, spreads them and misses.)
    Wire bytes are built per request from a shared serialised tail: two packed chunks of `TokenIds.ids`,
    which a parser concatenates, so no 100K-token message is copied per request."""

    def __init__(self, prompts: list[list[int]]) -> None:
        self.tails = [common_pb2.TokenIds(ids=p[1:]).SerializeToString() for p in prompts]
        self.next = 0

    def token_ids_bytes(self) -> bytes:
        k = self.next
        self.next += 1
        head = common_pb2.TokenIds(ids=[UNIQUE_BASE + k]).SerializeToString()
        return head + self.tails[k % len(self.tails)]


def _generate_calls(channels: list[grpc.aio.Channel], service: str, parse: Any) -> list[Any]:
    """`kvmesh.v1.<service>/Generate` on each channel, sending pre-serialised request bytes."""
    method = f"/kvmesh.v1.{service}/Generate"
    return [c.unary_stream(method, request_serializer=None, response_deserializer=parse) for c in channels]


async def _run(
    router: ServiceProcess,
    workers: list[ServiceProcess],
    sizes: list[int],
    requests: int,
    concurrency: int,
    c1_requests: int,
    connections_per_process: int = 0,
    features: Sequence[Feature] = (),
    max_tokens: int = 1,
) -> dict[str, Any]:
    """The gRPC run (module `kvmesh.bench.router`); `features`: each also measured as its own router and direct
    paths against the plain ones (`kvmesh.bench.router_features`)."""
    rng = random.Random(0)
    out: dict[str, Any] = {"router": {}, "direct": {}, "overhead_p50_ms": {}}
    # one connection per router process would pin a process to a connection: with several processes, 8 own
    # connections each (the kernel spreads connections over the processes, not calls)
    n = router_processes(router)
    n_conns = n * connections_per_process if connections_per_process else (1 if n == 1 else 8 * n)
    rchs = [
        grpc.aio.insecure_channel(router.address, options=[*OPTS, ("grpc.use_local_subchannel_pool", 1)])
        for _ in range(n_conns)
    ]
    router_calls = _generate_calls(rchs, "RouterService", router_pb2.RouterServiceGenerateResponse.FromString)
    wchs = [grpc.aio.insecure_channel(w.address, options=OPTS) for w in workers]
    worker_generate = _generate_calls(wchs, "WorkerService", worker_pb2.GenerateResponse.FromString)
    sp = common_pb2.SamplingParams(max_tokens=max_tokens, ignore_eos=True)
    router_ids_field = router_pb2.RouterServiceGenerateRequest.DESCRIPTOR.fields_by_name["token_ids"].number
    worker_ids_field = worker_pb2.GenerateRequest.DESCRIPTOR.fields_by_name["token_ids"].number
    for p in sizes:
        prompts = UniquePrompts([[rng.randrange(3, UNIQUE_BASE) for _ in range(p)] for _ in range(DISTINCT)])

        def paths(
            sampling: common_pb2.SamplingParams, p: int = p, prompts: UniquePrompts = prompts
        ) -> tuple[Callable[[int], Awaitable[None]], Callable[[int], Awaitable[None]]]:
            router_tail = router_pb2.RouterServiceGenerateRequest(sampling=sampling).SerializeToString()

            async def via_router(i: int) -> None:
                body = length_delimited(router_ids_field, prompts.token_ids_bytes()) + router_tail
                await _drain(router_calls[i % len(router_calls)](body, timeout=120))

            async def direct(i: int) -> None:
                k = prompts.next
                head = worker_pb2.GenerateRequest(request_id=f"d{p}-{k}", sampling=sampling).SerializeToString()
                body = head + length_delimited(worker_ids_field, prompts.token_ids_bytes())
                await _drain(worker_generate[k % len(worker_generate)](body, timeout=120))

            return direct, via_router

        sends: dict[str, Callable[[int], Awaitable[None]]] = {}
        for name, sampling in [("", sp), *((f"+{f.name}", f.grpc_sampling(sp)) for f in features)]:
            sends["direct" + name], sends["router" + name] = paths(sampling)  # direct first, as ever
        pids = {name: [router.proc.pid] for name in sends if name.startswith("router")}
        got = await measure(sends, c1_requests, requests, concurrency, c1_rounds(features, c1_requests), pids)
        out["direct"][str(p)] = got["direct"]
        out["router"][str(p)] = got["router"]
        for fname, figures in split_features(got, "router", features, max_tokens).items():
            out.setdefault("features", {}).setdefault(fname, {})[str(p)] = figures
        out["overhead_p50_ms"][str(p)] = round(
            out["router"][str(p)]["c1_p50_ms"] - out["direct"][str(p)]["c1_p50_ms"], 3
        )
    for c in [*rchs, *wchs]:
        await c.close()
    return out


def router_processes(router: ServiceProcess) -> int:
    """How many processes serve the router's ports (`--processes N` lists them in its ready file); the CPU
    counted for the router is its process tree's, so theirs with it."""
    return len(router_pids(router))


def router_pids(router: ServiceProcess) -> list[int]:
    """The processes that serve the router's requests: the one process, or the copies `--processes N` lists
    in its ready file (not their supervisor, which serves none)."""
    copies = [int(c["pid"]) for c in router.info.get("processes", [])]
    return copies or [router.proc.pid]


def _check_features(
    api: str,
    router: ServiceProcess,
    workers: list[ServiceProcess],
    prompt_tokens: int,
    max_tokens: int,
    features: Sequence[Feature],
    model_dir: Path | None,
) -> None:
    """One checked request per path before the run (`kvmesh.bench.router_features`); a failed check ends the
    bench with its reason (exit 1) instead of pricing a feature the router dropped or refused."""

    def grammar_seen() -> bool:
        return any(ACCEPTED_LOG in w.log() for w in workers)

    async def over_http() -> None:
        url = f"http://127.0.0.1:{router.http_port}"
        # the served name is the router's tokenizer folder (as `run_http` sends it)
        served = model_dir.name if model_dir else ""
        body = {"model": served, "prompt": "The quick brown fox", "max_tokens": max_tokens, "ignore_eos": True}
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=120)) as session:
            await wait_http(session, url, None)
            await check_http(session, url, f"http://127.0.0.1:{workers[0].http_port}", body, features, grammar_seen)

    rng = random.Random(1)
    prompt = [rng.randrange(3, UNIQUE_BASE) for _ in range(prompt_tokens)]
    sp = common_pb2.SamplingParams(max_tokens=max_tokens, ignore_eos=True)
    try:
        if api == "grpc":
            asyncio.run(check_grpc(router.address, workers[0].address, sp, features, prompt, grammar_seen))
        else:
            asyncio.run(over_http())
    except FeatureCheckError as exc:
        raise SystemExit(f"python -m kvmesh.bench router: {exc}") from None


_CM_ARGS = ("--checkpoint-interval-s", "0", "--warm-interval-s", "0", "--log-level", "WARNING")


def main(argv: Sequence[str]) -> int:
    ap = argparse.ArgumentParser(prog="python -m kvmesh.bench router")
    ap.add_argument("--workers", type=int, default=16)
    ap.add_argument("--prompt-tokens", default="1024,8192,102400")
    ap.add_argument("--requests", type=int, default=2000)
    ap.add_argument("--c1-requests", type=int, default=200)
    ap.add_argument("--concurrency", type=int, default=32)
    ap.add_argument("--block-size", type=int, default=32)
    ap.add_argument(
        "--api", choices=("grpc", "http"), default="grpc", help="grpc: router vs direct; http: see --compare"
    )
    ap.add_argument(
        "--router-processes", type=int, default=1, help="kvmesh router processes sharing its ports (--processes)"
    )
    ap.add_argument(
        "--router-cpu-cap",
        type=float,
        default=0.0,
        help="cap each kvmesh router process at this many cores (a cgroup each, kvmesh.bench.cpu_cap): the "
        "routers are the limit, as where they have cores of their own; 0 = no cap",
    )
    ap.add_argument(
        "--router-connections",
        type=int,
        default=0,
        help="grpc only: the client's connections per router process (default: 1 for one process, else 8)",
    )
    ap.add_argument(
        "--worker-transport",
        choices=("stream", "frames"),
        default="stream",
        help="router → worker: stream (the default, one gRPC GenerateStream per worker) or frames (the opt-in "
        "fast path: the workers' --frames-port, opaque to a service mesh); run both to show its gain",
    )
    ap.add_argument("--compare", default="", help="http only: also sglang and/or vllm (comma-separated)")
    ap.add_argument("--routers-path", default="", help="folder holding the sglang-router / vllm-router packages")
    ap.add_argument(
        "--distinct-prompts",
        type=int,
        default=DISTINCT,
        help="http only: different prompts per size, sent in turn (a repeated text hits the router's "
        "tokenisation cache; as many as the requests sent: every prompt new)",
    )
    ap.add_argument(
        "--client-processes",
        type=int,
        default=1,
        help="http only: client processes sending the concurrency runs (where one client is the bottleneck)",
    )
    ap.add_argument("--max-tokens", type=int, default=1, help="tokens generated per request (ignore_eos)")
    ap.add_argument(
        "--logprobs",
        type=int,
        default=None,
        metavar="K",
        help="also measure requests asking for each token's log-probability and its K most likely alternatives, "
        "against the plain path in the same run (kvmesh.bench.router_features)",
    )
    ap.add_argument(
        "--response-format",
        choices=RESPONSE_FORMATS,
        default="",
        help="also measure requests with a structured output (json: any JSON object, json_schema: a small schema) "
        "against the plain path; the workers are then bench-only grammar stand-ins (kvmesh.bench.grammar_stand_in: "
        "they accept the grammar and do not constrain)",
    )
    a = ap.parse_args(list(argv))
    if a.max_tokens < 1:
        ap.error(f"--max-tokens must be >= 1, got {a.max_tokens}")
    if a.logprobs is not None and not 0 <= a.logprobs <= LOGPROBS_MAX:
        ap.error(f"--logprobs must be in [0, {LOGPROBS_MAX}], got {a.logprobs}")
    features = features_from_flags(a.logprobs, a.response_format)
    if features and (a.compare or a.client_processes > 1):
        ap.error("--logprobs and --response-format measure kvmesh alone: not with --compare or --client-processes")
    if a.client_processes < 1:
        ap.error(f"--client-processes must be >= 1, got {a.client_processes}")
    if a.client_processes > 1 and a.api != "http":
        ap.error("--client-processes applies to --api http only")
    if a.distinct_prompts < 1:
        ap.error(f"--distinct-prompts must be >= 1, got {a.distinct_prompts}")
    if a.router_processes < 1:
        ap.error(f"--router-processes must be >= 1, got {a.router_processes}")
    if a.router_connections < 0 or (a.router_connections and a.api != "grpc"):
        ap.error("--router-connections must be >= 1, and applies to --api grpc only")
    caps: CpuCaps | None = None
    capped = 0
    if a.router_cpu_cap:
        try:
            caps = CpuCaps(a.router_cpu_cap)
        except (ValueError, CpuCapError) as exc:
            ap.error(f"--router-cpu-cap: {exc}")
    compare = [c for c in a.compare.split(",") if c]
    sizes = [int(x) for x in a.prompt_tokens.split(",")]
    max_len = int(max(sizes) * 1.05) + 64 + a.max_tokens  # text prompts are only about P tokens
    kv_blocks = max(65536, 4 * a.concurrency * max_len // a.block_size)
    procs: list[ServiceProcess] = []
    others: dict[str, subprocess.Popen[bytes]] = {}
    with tempfile.TemporaryDirectory(prefix="kvmesh-bench-router-") as tmp:
        try:
            zmq = [f"tcp://127.0.0.1:{free_port()}" for _ in range(a.workers)] if "vllm" in compare else []
            wargs = [
                "--engine",
                "sim",
                "--sim-speed",
                "0",
                "--block-size",
                str(a.block_size),
                "--kv-blocks",
                str(kv_blocks),
                "--max-model-len",
                str(max_len),
                "--max-queue",
                "100000",
                "--log-level",
                "WARNING",
                *(["--frames-port", "0"] if a.worker_transport == "frames" else []),  # the listener is opt-in
            ]
            model_dir = resolve_model_dir("")
            cm: ServiceProcess | None = None  # http: kvmesh as deployed, routing on its cache-manager's index
            if a.api == "http":  # text prompts: everyone tokenises with the tiny model's tokenizer
                if model_dir is None:
                    raise SystemExit("--api http needs the tiny model: run scripts/build_tiny_model.py")
                wargs += ["--model", str(model_dir)]
                cm = start_service("cache-manager", Path(tmp), "--block-size", str(a.block_size), *_CM_ARGS)
                procs.append(cm)
                wargs += ["--cache-manager", cm.address]
            # the normal worker serves the probe paths third-party routers use (/health, /model_info, ...)
            # a structured output needs workers that accept one: the bench-only stand-in (module docstring)
            start_worker = (
                start_stand_in_worker if any(f.grammar for f in features) else partial(start_service, "worker")
            )
            workers = [
                start_worker(Path(tmp), *wargs, *(["--zmq-publish", zmq[i]] if compare and zmq else []))
                for i in range(a.workers)
            ]
            procs += workers
            router = start_service(
                "router",
                Path(tmp),
                "--workers",
                ",".join(w.address for w in workers),
                "--block-size",
                str(a.block_size),
                "--max-prompt-tokens",
                str(max_len),
                "--short-concurrency",
                "4096",
                "--long-concurrency",
                "4096",
                "--log-level",
                "WARNING",
                "--processes",
                str(a.router_processes),
                "--worker-transport",
                a.worker_transport,
                # an instant engine recomputes for free, so a KV pull from a peer never pays here (it only
                # burns the shared cores); the perf model assumes GPU prefill times and would hint pulls
                *(["--cache-manager", cm.address, "--kv-pull-margin", "0"] if cm else []),
            )
            procs.append(router)
            if caps is not None:
                try:
                    for pid in router_pids(router):
                        caps.cap(pid)
                except CpuCapError as exc:
                    ap.error(f"--router-cpu-cap: {exc}")  # exits 2; the processes stop below
                capped = len(caps.groups)
            if features:
                _check_features(a.api, router, workers, sizes[0], a.max_tokens, features, model_dir)
            if a.api == "grpc":
                res = asyncio.run(
                    _run(
                        router,
                        workers,
                        sizes,
                        a.requests,
                        a.concurrency,
                        a.c1_requests,
                        a.router_connections,
                        features,
                        a.max_tokens,
                    )
                )
            else:
                wurls = [f"http://127.0.0.1:{w.http_port}" for w in workers]
                targets = {"direct": wurls, "kvmesh": [f"http://127.0.0.1:{router.http_port}"]}
                for kind in compare:
                    proc, url = start_third_party(
                        kind, a.routers_path, wurls, zmq, a.block_size, Path(tmp) / f"{kind}.log"
                    )
                    others[kind] = proc
                    targets[kind] = [url]
                assert model_dir is not None  # checked above for --api http
                tok = HfTokenizer(str(model_dir))  # what the kvmesh router's tokenizer loads from the same folder
                served = model_dir.name  # the kvmesh router's /v1/models name (its tokenizer folder)
                assert cm is not None  # started for --api http
                pids = {"kvmesh": [router.proc.pid, cm.proc.pid], **{k: [p.pid] for k, p in others.items()}}
                res = asyncio.run(
                    run_http(
                        tok,
                        targets,
                        others,
                        sizes,
                        a.requests,
                        a.concurrency,
                        a.c1_requests,
                        served,
                        pids,
                        a.distinct_prompts,
                        a.client_processes,
                        features,
                        a.max_tokens,
                    )
                )
        finally:
            for proc in others.values():
                proc.terminate()
                try:
                    proc.wait(timeout=15)
                except subprocess.TimeoutExpired:
                    proc.kill()
            for sp in reversed(procs):
                try:
                    sp.terminate(timeout=15)
                except Exception:
                    sp.kill()
            if caps is not None:
                caps.close()
    res.update(
        {"bench": "router", "api": a.api, "workers": a.workers, "requests": a.requests, "concurrency": a.concurrency}
        | {"router_processes": a.router_processes, "router_cpu_cap": a.router_cpu_cap, "router_cpu_capped": capped}
        | {"worker_transport": a.worker_transport, "max_tokens": a.max_tokens}
        | ({"logprobs": a.logprobs} if a.logprobs is not None else {})
        | ({"response_format": a.response_format, "grammar_workers": STAND_IN} if a.response_format else {})
        | ({"router_connections": a.router_connections} if a.router_connections else {})
        | ({"distinct_prompts": a.distinct_prompts, "client_processes": a.client_processes} if a.api == "http" else {})
    )
    print(json.dumps(res, sort_keys=True))
    return 0
