"""HTTP comparison of routers in front of the same instant workers (see `kvmesh.bench.router`).

    python -m kvmesh.bench router --api http --compare sglang,vllm --routers-path DIR [--workers 16 ...]

Every target gets the same OpenAI `POST /v1/completions` with a *text* prompt of about P tokens (the third-party
routers accept only text prompts; workers and router use the tiny model's tokenizer) and `max_tokens=1`, from
the same aiohttp client: `direct` (worker HTTP APIs, round-robin by the client), `kvmesh` (the kvmesh router's
HTTP API), `sglang` (`sglang-router launch --policy cache_aware`) and `vllm` (`vllm-router --policy kv_aware`,
fed by the workers' vLLM-format ZMQ KV events). The third-party routers are the PyPI packages
`sglang-router` / `vllm-router`, installed by the caller into DIR (`pip install --target DIR --no-deps
sglang-router vllm-router orjson`); they are started as subprocesses on free loopback ports and used once
`GET /v1/models` answers through them (bounded wait).

The kvmesh router runs as it is deployed, with a cache-manager (the workers publish their KV events to it,
the router follows its index), so it sends a repeated prompt to the worker that holds it, as the others do.

``--client-processes N``: where the one aiohttp client is the bottleneck (it parses every answer in Python on
the same cores), each concurrency run is sent by N client processes (`kvmesh.bench.load_client`), the
concurrency and the requests shared among them; the c1 runs stay in this process.

The concurrency runs are taken in up to `CC_ROUNDS` rounds (an even count, each of at least twice the
concurrency), the paths in forward order in even rounds and in reverse in odd ones (A B, B A, A B, ...): a
change in the workers' state over the run (the simulated KV pools fill, then every new block evicts one and
spills it to the CPU tier) lands on every path alike. Run one after the other, the later path paid for it:
at 8K over gRPC the router served 1.42× direct when it ran first and 0.75× when it ran second
(docs/benchmarks.md).

``cpu_us_per_request`` (under each router and size): the CPU time, user + system, that the router's
processes (for kvmesh: the router and its cache-manager) and their descendants spent during the concurrency
run, divided by its requests, in µs (`kvmesh.bench.process_cpu.tree_cpu_s`: each process's CPU-time clock, to
the nanosecond). Unlike requests/s it does not depend on how many cores the router had or on what else ran on
the machine, so it carries from one machine to the next.

``host_cpu_us_per_request`` (under every path and size, `direct` included): the busy CPU time of the whole
machine (every core, from /proc/stat: all but idle and I/O wait) during the path's concurrency run, per
request, in µs. Where client, router and workers share the cores it explains router ÷ direct: the path that
costs the machine more CPU per request serves fewer requests/s. It counts whatever else ran meanwhile.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import random
import subprocess
import sys
import tempfile
import time
from collections.abc import Awaitable, Callable, Sequence
from pathlib import Path
from typing import Any

import aiohttp

from kvmesh.bench.load_client import ProcessClients, completion_sender
from kvmesh.bench.process_cpu import host_busy_s, tree_cpu_s
from kvmesh.bench.router_features import Feature, c1_rounds, path, split_features
from kvmesh.core.ports import free_port
from kvmesh.engine.tokenizer import Tokenizer

DISTINCT = 64  # prompts per size, sent in turn (--distinct-prompts)


def _pct(xs: list[float], q: float) -> float:
    s = sorted(xs)
    return s[min(int(q * len(s)), len(s) - 1)]


CC_ROUNDS = 8  # rounds of each path's concurrency run, at most (module docstring)

# (path, first request index, requests, concurrency) -> once its load is ready to go, the call that sends it
# and returns the wall seconds it took (`in_process`, or `ProcessClients` for --client-processes N)
Concurrent = Callable[[str, int, int, int], Awaitable[Callable[[], Awaitable[float]]]]


async def measure(
    sends: dict[str, Callable[[int], Awaitable[None]]],
    n_c1: int,
    n_cc: int,
    concurrency: int,
    rounds: int = 4,
    pids: dict[str, list[int]] | None = None,
    concurrent: Concurrent | None = None,
    cc_rounds: int = CC_ROUNDS,
) -> dict[str, dict[str, float]]:
    """Per path: c1 p50/p99 (ms) of `n_c1` sequential requests and requests/s of `n_cc` at `concurrency`, and
    for a path in `pids` (its router's processes) the CPU µs per request of the concurrency run.
    The c1 samples of all paths are taken in `rounds` interleaved rounds (after a warm-up of every path), so a
    slow spell of this shared machine lands on every path instead of biasing one side of a difference.
    The concurrency runs are taken in `cc_rounds` rounds, in A B, B A order (module docstring).
    `send(i)` gets i = 0, 1, ... per path; the concurrency run is `concurrent`'s (default: this process's)."""
    nxt = dict.fromkeys(sends, 0)

    async def one(name: str) -> None:
        i = nxt[name]
        nxt[name] = i + 1
        await sends[name](i)

    async def in_process(name: str, first: int, n: int, conc: int) -> Callable[[], Awaitable[float]]:
        indices = iter(range(first, first + n))  # shared by the loops: each index sent once

        async def loop() -> None:
            for i in indices:
                await sends[name](i)

        async def go() -> float:
            t0 = time.perf_counter()
            await asyncio.gather(*(loop() for _ in range(conc)))
            return time.perf_counter() - t0

        return go

    for name in sends:
        for _ in range(min(32, n_c1)):
            await one(name)
    lat: dict[str, list[float]] = {name: [] for name in sends}
    per_round = _shares(n_c1, rounds)
    for n in per_round:
        for name in sends:
            for _ in range(n):
                t0 = time.perf_counter()
                await one(name)
                lat[name].append((time.perf_counter() - t0) * 1000)
    wall, cpu, host = dict.fromkeys(sends, 0.0), dict.fromkeys(sends, 0.0), dict.fromkeys(sends, 0.0)
    owned = pids or {}
    names = list(sends)
    for r, n in enumerate(_shares(n_cc, _cc_round_count(n_cc, concurrency, cc_rounds))):
        for name in names if r % 2 == 0 else names[::-1]:  # A B, B A, ...: drift in the workers' state cancels
            go = await (concurrent or in_process)(name, nxt[name], n, concurrency)
            nxt[name] += n
            own = owned.get(name, [])
            cpu0, host0 = sum(map(tree_cpu_s, own)), host_busy_s()
            wall[name] += await go()
            host[name] += host_busy_s() - host0
            cpu[name] += sum(map(tree_cpu_s, own)) - cpu0
    out: dict[str, dict[str, float]] = {}
    for name in sends:
        out[name] = {
            "c1_p50_ms": round(_pct(lat[name], 0.5), 3),
            "c1_p99_ms": round(_pct(lat[name], 0.99), 3),
            f"c{concurrency}_rps": round(n_cc / wall[name], 1),
            "host_cpu_us_per_request": round(host[name] / n_cc * 1e6, 1),
        }
        if owned.get(name):
            out[name]["cpu_us_per_request"] = round(cpu[name] / n_cc * 1e6, 1)
    return out


def _cc_round_count(n_cc: int, concurrency: int, most: int) -> int:
    """Rounds of a concurrency run: at most `most`, each of at least 2 x `concurrency` requests (a round
    shorter than that is mostly its ramp up and down), an even count where there are several (every path
    first as often as last)."""
    rounds = min(most, n_cc // (2 * concurrency))
    return max(1, rounds - rounds % 2)


def _shares(n: int, parts: int) -> list[int]:
    """`n` split into `parts` near-equal positive counts (fewer parts when `n` is smaller)."""
    parts = max(1, min(parts, n))
    return [n // parts + (1 if r < n % parts else 0) for r in range(parts)]


def start_third_party(
    kind: str, routers_path: str, worker_urls: list[str], zmq: list[str], block_size: int, log: Path
) -> tuple[subprocess.Popen[bytes], str]:
    """Starts sglang-router (cache_aware) or vllm-router (kv_aware); returns (process, base URL)."""
    port = free_port()
    env = {**os.environ, "PYTHONPATH": routers_path}
    if kind == "sglang":
        cmd = [sys.executable, f"{routers_path}/bin/sglang-router", "launch", "--policy", "cache_aware"]
    else:
        cmd = [
            sys.executable,
            f"{routers_path}/bin/vllm-router",
            "--policy",
            "kv_aware",
            "--kv-event-block-size",
            str(block_size),
            "--kv-event-model",
            "sim",
        ]
        for u, z in zip(worker_urls, zmq, strict=True):
            cmd += ["--kv-event-source", f"{u}={z}"]
    cmd += [
        "--host",
        "127.0.0.1",
        "--port",
        str(port),
        "--health-check-endpoint",
        "/healthz",
        "--health-check-interval-secs",
        "1",
        "--prometheus-host",
        "127.0.0.1",
        "--prometheus-port",
        str(free_port()),
        "--worker-urls",
        *worker_urls,
    ]
    with open(log, "wb") as f:
        proc = subprocess.Popen(cmd, stdout=f, stderr=subprocess.STDOUT, env=env, start_new_session=True)
    _LOGS[proc.pid] = log
    return proc, f"http://127.0.0.1:{port}"


_LOGS: dict[int, Path] = {}


def _log_tail(proc: subprocess.Popen[bytes]) -> str:
    p = _LOGS.get(proc.pid)
    return p.read_text(errors="replace")[-1500:] if p and p.exists() else ""


async def wait_http(
    session: aiohttp.ClientSession, url: str, proc: subprocess.Popen[bytes] | None, timeout: float = 60.0
) -> None:
    """Bounded readiness wait: `GET url/v1/models` answers 200 (the process must stay alive)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc is not None and proc.poll() is not None:
            raise RuntimeError(f"{url}: router exited with {proc.returncode}: {_log_tail(proc)}")
        with contextlib.suppress(aiohttp.ClientError, OSError):
            async with session.get(url + "/v1/models") as r:
                if r.status == 200:
                    return
        await asyncio.sleep(0.2)
    raise TimeoutError(f"{url} not ready within {timeout}s: {_log_tail(proc) if proc else ''}")


def make_text(tok: Tokenizer, n_tokens: int, rng: random.Random) -> str:
    """Text of about `n_tokens` tokens under `tok`: random ids decoded, trimmed by re-encoding (bounded)."""
    ids = [rng.randrange(3, 1000) for _ in range(n_tokens)]
    text = tok.decode(ids)
    for _ in range(8):
        n = len(tok.encode(text))
        if abs(n - n_tokens) <= max(n_tokens // 100, 4):
            break
        text = (
            text[: max(int(len(text) * n_tokens / max(n, 1)), 1)]
            if n > n_tokens
            else text + " " + tok.decode([rng.randrange(3, 1000) for _ in range(n_tokens - n)])
        )
    return text


async def run_http(
    tok: Tokenizer,
    targets: dict[str, list[str]],
    procs: dict[str, subprocess.Popen[bytes]],
    sizes: list[int],
    requests: int,
    concurrency: int,
    c1_requests: int,
    model: str,
    pids: dict[str, list[int]],
    distinct: int = DISTINCT,
    client_processes: int = 1,
    features: Sequence[Feature] = (),
    max_tokens: int = 1,
) -> dict[str, Any]:
    """`model`: the served model name (the routers' /v1/models), sent as the body's "model"; `pids`: each
    router's processes (their CPU time per request); `distinct`: different prompts per size, sent in turn (the
    kvmesh router tokenises a repeated text once: `distinct` >= the requests sent makes every prompt new);
    `client_processes` > 1: the concurrency runs are sent by that many client processes (`ProcessClients`);
    `features`: each also measured as `kvmesh+<feature>` and `direct+<feature>` against the plain paths
    (`kvmesh.bench.router_features`, in-process client only); `max_tokens`: generated per request."""
    rng = random.Random(0)
    out: dict[str, Any] = {name: {} for name in targets}
    conn = aiohttp.TCPConnector(limit=4 * concurrency)
    with tempfile.TemporaryDirectory(prefix="kvmesh-bench-clients-") as tmp_name:
        tmp = Path(tmp_name)
        async with aiohttp.ClientSession(connector=conn, timeout=aiohttp.ClientTimeout(total=300)) as session:
            for name, urls in targets.items():
                await wait_http(session, urls[0], procs.get(name))
            for p in sizes:
                texts = [make_text(tok, p, rng) for _ in range(distinct)]
                out.setdefault("prompt_tokens", {})[str(p)] = round(sum(len(tok.encode(t)) for t in texts) / distinct)
                bodies = [{"model": model, "prompt": t, "max_tokens": max_tokens, "ignore_eos": True} for t in texts]

                concurrent = None
                if client_processes > 1:
                    bodies_file = tmp / f"bodies-{p}.json"
                    bodies_file.write_text(json.dumps(bodies))
                    concurrent = ProcessClients(client_processes, targets, bodies_file, tmp)
                sends = {name: completion_sender(session, urls, bodies) for name, urls in targets.items()}
                feature_pids = dict(pids)
                for f in features:
                    with_f = [f.http_body(b) for b in bodies]
                    for name in ("direct", "kvmesh"):
                        sends[path(name, f)] = completion_sender(session, targets[name], with_f)
                    feature_pids[path("kvmesh", f)] = pids["kvmesh"]
                rounds = c1_rounds(features, c1_requests)
                got = await measure(sends, c1_requests, requests, concurrency, rounds, feature_pids, concurrent)
                for name in targets:
                    out[name][str(p)] = got[name]
                for fname, figures in split_features(got, "kvmesh", features, max_tokens).items():
                    out.setdefault("features", {}).setdefault(fname, {})[str(p)] = figures
    return out
