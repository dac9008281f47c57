"""``python -m kvmesh.bench pd``: prefill/decode disaggregation against aggregated serving, on the same load,
through a real kvmesh router.

    python -m kvmesh.bench pd --engine vllm|sim [--streams 4] [--stream-tokens 96] [--long-prompts 6] ...

Two phases, one after the other, each its own processes on loopback (stopped before the next starts): two
workers (real vLLM with the tiny model, each engine pinned to its own cores as in `bench balance`, or
simulated) behind a kvmesh router, the client streaming from the router's `RouterService.Generate` as any
client does:

- aggregated: two workers of role `both` (the router's decision has no prefill pool: every request aggregated,
  placed by its routing profile);
- disaggregated: one `--role prefill` and one `--role decode` worker; the router decides per request
  (`kvmesh.routing.disagg`): a long prompt's prefill half on the prefill worker, its KV handed to the decode
  worker (vLLM's NIXL where installed, else kv-sync from the prefill worker's CPU tier), a short one served
  aggregated on the decode worker.

The load, the same in both phases: `--streams` requests of a short prompt decoding `--stream-tokens` tokens
each, and, while they decode, `--long-prompts` requests of `--long-tokens` prompt tokens arriving every
`--gap-ms`. Each phase first sends a warm-up through its router (the load's prompts reversed: no block
shared with the measured ones; kernels' first runs, NIXL's handshake), unmeasured.

One JSON line: per phase TTFT (every request that got a token, client side: sent to first token) and ITL
(the streams' gaps between tokens, while long prompts arrive) p50/p99, ms, the requests the router migrated
(its stall detection) and those that failed, by status code (the services' last warnings then go to stderr);
`outputs_equal` (every request's greedy tokens the same in both phases); from the disaggregated
router's /metrics over the measured load: `handoffs` (disaggregated decisions whose prefill half handed KV
over), `fallbacks` (`kvmesh_handoff_fallbacks_total`: disaggregated requests served otherwise), the decisions
by mode and reason, the blocks handed over; and from its workers' /metrics how the KV moved: `nixl` (the
decode engine's `kvmesh_worker_engine_handoffs`: received, and fallbacks: computed instead) and `kv_sync`
(the prefill worker's `kvmesh_worker_handoffs_total`: holds collected or expired).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import random
import tempfile
import time
from collections import Counter
from collections.abc import Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import grpc

from kvmesh.bench.balance import percentile
from kvmesh.bench.zone_follow import scrape, total
from kvmesh.core.modelfiles import resolve_model_dir
from kvmesh.discovery.model import WORKER_ROLE_META
from kvmesh.suite.launcher import ServiceProcess, start_service, vllm_core_env
from kvmesh.v1 import common_pb2, router_pb2, router_pb2_grpc

BLOCK_SIZE = 32
TOKEN_LOW, TOKEN_HIGH = 200, 1000  # the tiny model's clean-text ids (vocabulary 1024), valid for the sim too
AGGREGATED, DISAGGREGATED = "aggregated", "disaggregated"
ROLES = {AGGREGATED: ("both", "both"), DISAGGREGATED: ("prefill", "decode")}
log = logging.getLogger(__name__)
Samples = dict[str, list[tuple[dict[str, str], float]]]  # a /metrics page by sample name (`zone_follow.scrape`)


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
    migrations: int = 0
    error: str = ""  # the router's status code when the request failed (its tokens then fall short)


@dataclass
class Phase:
    """A phase's processes: its two workers (in `ROLES` order) and the router over them."""

    workers: list[ServiceProcess]
    router: ServiceProcess

    def stop(self) -> None:
        for p in [self.router, *self.workers]:
            try:
                p.terminate(timeout=30)
            except Exception:
                p.kill()


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


def warm_up_load(jobs: Sequence[Job]) -> list[Job]:
    """A quarter of the load, prompts reversed (no block shared with the measured prompts), 4 tokens each."""
    return [Job(f"w{j.name}", j.prompt[::-1], 4, 0.0, j.stream) for j in jobs[:: max(1, len(jobs) // 4)]]


async def _stream(stub: router_pb2_grpc.RouterServiceStub, job: Job, rid: str, res: Result) -> None:
    """`job` through the router: tokens, TTFT, gaps between token messages (per token), migrations."""
    req = router_pb2.RouterServiceGenerateRequest(
        request_id=rid,
        token_ids=common_pb2.TokenIds(ids=job.prompt),
        sampling=common_pb2.SamplingParams(max_tokens=job.max_tokens, temperature=0, ignore_eos=True),
    )
    t0 = time.perf_counter()
    last: float | None = None
    async for msg in stub.Generate(req, timeout=600):
        res.migrations = max(res.migrations, msg.migrations)
        if not msg.token_ids:
            continue
        now = time.perf_counter()
        if last is None:
            res.ttft_ms = 1000 * (now - t0)
        else:
            res.gaps_ms += [1000 * (now - last) / len(msg.token_ids)] * len(msg.token_ids)
        last = now
        res.tokens += list(msg.token_ids)


async def send_load(router_address: str, jobs: Sequence[Job], prefix: str) -> dict[str, Result]:
    """Sends `jobs` through the router at their times, each its own stream."""
    results: dict[str, Result] = {}
    async with grpc.aio.insecure_channel(router_address) as ch:
        stub = router_pb2_grpc.RouterServiceStub(ch)

        async def one(job: Job, phase_t0: float) -> None:
            await asyncio.sleep(max(0.0, phase_t0 + job.start_s - time.perf_counter()))
            res = results[job.name] = Result(job.stream)
            try:
                await _stream(stub, job, f"{prefix}-{job.name}", res)
            except grpc.aio.AioRpcError as e:  # what the client got: counted, the other requests go on
                res.error = e.code().name
                log.warning("request %s-%s failed: %s %s", prefix, job.name, res.error, e.details())

        t0 = time.perf_counter()
        await asyncio.gather(*(one(j, t0) for j in jobs))
    return results


def summary(results: Mapping[str, Result]) -> dict[str, Any]:
    """TTFT of the requests that got a token, ITL of the streams, and how many requests the router migrated
    or failed (by status code)."""
    ttft = [r.ttft_ms for r in results.values() if r.tokens]
    gaps = [g for r in results.values() if r.stream for g in r.gaps_ms]

    def p(xs: list[float], q: float) -> float | None:
        return round(percentile(xs, q), 1) if xs else None

    return {
        "ttft_ms": {"p50": p(ttft, 0.5), "p99": p(ttft, 0.99)},
        "itl_ms": {"p50": p(gaps, 0.5), "p99": p(gaps, 0.99)},
        "migrated": sum(1 for r in results.values() if r.migrations),
        "failed": dict(sorted(Counter(r.error for r in results.values() if r.error).items())),
    }


def _delta(before: Samples, after: Samples, name: str, /, **labels: str) -> float:
    return total(after, name, **labels) - total(before, name, **labels)


def _by_label(before: Samples, after: Samples, name: str, label: str) -> dict[str, float]:
    """`name`'s growth between the two scrapes per value of `label` (values that did not grow left out)."""
    values = {lab.get(label, "") for lab, _ in after.get(name, [])}
    grown = {v: _delta(before, after, name, **{label: v}) for v in sorted(values)}
    return {v: d for v, d in grown.items() if d}


def handoff_counts(
    router: tuple[Samples, Samples], prefill: tuple[Samples, Samples], decode: tuple[Samples, Samples]
) -> dict[str, Any]:
    """What the disaggregated phase's measured load did, from /metrics scraped before and after it: the
    router's decisions and fallbacks (`handoffs`: disaggregated decisions minus fallbacks), and how the KV
    moved (the decode engine's NIXL loads, the prefill worker's kv-sync holds)."""
    decisions = {
        f"{lab['mode']}/{lab['reason']}": _delta(*router, "kvmesh_pd_decisions_total", **lab)
        for lab, _ in router[1].get("kvmesh_pd_decisions_total", [])
    }
    decisions = {k: int(v) for k, v in sorted(decisions.items()) if v}
    fallbacks = _by_label(*router, "kvmesh_handoff_fallbacks_total", "cause")
    disaggregated = sum(v for k, v in decisions.items() if k.startswith(f"{DISAGGREGATED}/"))
    nixl = _by_label(*decode, "kvmesh_worker_engine_handoffs", "event")
    return {
        "handoffs": int(disaggregated - sum(fallbacks.values())),
        "fallbacks": int(sum(fallbacks.values())),
        "fallback_causes": {k: int(v) for k, v in fallbacks.items()},
        "pd_decisions": decisions,
        "handoff_blocks": int(_delta(*router, "kvmesh_handoff_blocks_total")),
        "nixl": {k: int(v) for k, v in nixl.items() if k in ("received", "fallbacks")},
        "kv_sync": {k: int(v) for k, v in _by_label(*prefill, "kvmesh_worker_handoffs_total", "outcome").items()},
    }


def _worker_args(setup: PdSetup) -> tuple[list[str], list[dict[str, str]], float, list[str]]:
    """The workers' flags (a CPU tier: kv-sync handoffs), each one's environment, the start timeout, and the
    router's model flags (its tokenizer)."""
    if setup.engine == "sim":
        args = ["--engine", "sim", "--block-size", str(BLOCK_SIZE), "--kv-blocks", "4096", "--cpu-tier-mb", "64"]
        return [*args, "--handoff-hold-ms", str(setup.hold_ms)], [{}, {}], 60.0, []
    model = resolve_model_dir("")
    if model is None:
        raise SystemExit("the vllm engine needs the tiny model: run scripts/build_tiny_model.py")
    args = ["--engine", "vllm", "--model", str(model), "--block-size", str(BLOCK_SIZE), "--max-model-len", "2048"]
    args += ["--vllm-dtype", "bfloat16", "--handoff-hold-ms", str(setup.hold_ms)]
    env = {"VLLM_CPU_KVCACHE_SPACE": "1", "HF_HUB_OFFLINE": "1"}
    return args, [{**env, **e} for e in vllm_core_env(2, pinned=True)], 600.0, ["--model", str(model)]


def start_phase(mode: str, setup: PdSetup, tmp: Path) -> Phase:
    """The phase's two workers (in parallel: vLLM takes a while) with `ROLES[mode]`, then the router over them,
    returned once the router sees both workers' roles and load."""
    args, envs, timeout, router_model = _worker_args(setup)
    roles = ROLES[mode]
    procs: list[ServiceProcess] = []
    with ThreadPoolExecutor(2) as ex:
        futs = [
            ex.submit(
                start_service, "worker", tmp / f"{mode}-{role}", *args, "--role", role, env=envs[i], timeout=timeout
            )
            for i, role in enumerate(roles)
        ]
        try:
            for f in futs:
                procs.append(f.result())
        except Exception:
            for p in procs:
                p.kill()
            raise
    try:
        router = start_service(
            "router",
            tmp / f"{mode}-router",
            "--workers",
            ",".join(p.address for p in procs),
            "--block-size",
            str(BLOCK_SIZE),
            "--pd-hold-ms",
            str(setup.hold_ms),
            *router_model,
        )
    except Exception:
        for p in procs:
            p.kill()
        raise
    phase = Phase(procs, router)
    try:
        _wait_for_workers(router.address, sorted(roles))
    except Exception:
        phase.stop()
        raise
    return phase


def _wait_for_workers(router_address: str, roles: list[str], timeout_s: float = 60.0) -> None:
    """Until the router lists the workers with their roles (from GetInfo) and a load report each: before that
    its decision could not see the prefill pool."""
    deadline = time.monotonic() + timeout_s
    seen: list[str] = []
    with grpc.insecure_channel(router_address) as ch:
        admin = router_pb2_grpc.RouterAdminServiceStub(ch)
        while time.monotonic() < deadline:
            listed = admin.ListWorkers(router_pb2.ListWorkersRequest(), timeout=10).workers
            seen = sorted(w.endpoint.meta.get(WORKER_ROLE_META, "") for w in listed if w.load.timestamp)
            if seen == roles:
                return
            time.sleep(0.2)  # polling the router's view: there is no event to wait on
    raise RuntimeError(f"the router listed workers {seen}, not {roles}, within {timeout_s} s")


def run_phase(mode: str, setup: PdSetup, jobs: Sequence[Job], tmp: Path) -> tuple[dict[str, Result], dict[str, Any]]:
    """Starts the phase, warms it up, sends `jobs`, stops it; the results and (disaggregated) the handoff
    counts of the measured load."""
    phase = start_phase(mode, setup, tmp)
    try:
        asyncio.run(send_load(phase.router.address, warm_up_load(jobs), f"{mode}-warm"))
        ports = [phase.router.http_port, *(w.http_port for w in phase.workers)]
        before = [scrape(p) for p in ports]
        results = asyncio.run(send_load(phase.router.address, jobs, mode))
        after = [scrape(p) for p in ports]
        if any(r.error for r in results.values()):
            _log_warnings(phase)
    finally:
        phase.stop()
    counts = handoff_counts(*zip(before, after, strict=True)) if mode == DISAGGREGATED else {}
    return results, counts


def _log_warnings(phase: Phase, last: int = 20) -> None:
    """The services' last warnings and errors (why the router refused or lost a request: a worker out of
    rotation, a breaker open), before the phase's run directory goes."""
    for sp in [phase.router, *phase.workers]:
        lines = [ln for ln in sp.log().splitlines() if " WARNING " in ln or " ERROR " in ln]
        for ln in lines[-last:]:
            log.warning("%s: %s", sp.name, ln)


def run_pd(setup: PdSetup) -> dict[str, Any]:
    jobs = load(setup)
    with tempfile.TemporaryDirectory(prefix="kvmesh-bench-pd-") as tmp:
        agg, _ = run_phase(AGGREGATED, setup, jobs, Path(tmp))
        dis, counts = run_phase(DISAGGREGATED, setup, jobs, Path(tmp))
    failed = any(r.error for r in [*agg.values(), *dis.values()])  # a failed request's tokens fall short
    return {
        "engine": setup.engine,
        AGGREGATED: summary(agg),
        DISAGGREGATED: summary(dis),
        "outputs_equal": not failed and all(agg[j.name].tokens == dis[j.name].tokens for j in jobs),
        **counts,
        "requests": len(jobs),
    }


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
    ap.add_argument("--hold-ms", type=int, default=d.hold_ms, help="a prefill half's hold (router and workers)")
    ap.add_argument("--seed", type=int, default=d.seed)
    a = ap.parse_args(list(argv))
    for name in ("streams", "stream_prompt_tokens", "stream_tokens", "long_tokens", "long_max_tokens", "hold_ms"):
        if getattr(a, name) < 1:
            ap.error(f"--{name.replace('_', '-')} must be at least 1")
    if a.long_prompts < 0 or a.gap_ms < 0:
        ap.error("--long-prompts and --gap-ms must be at least 0")
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
