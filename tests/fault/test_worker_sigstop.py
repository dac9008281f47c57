"""A worker frozen with SIGSTOP under traffic (real router and sim worker processes on 127.0.0.1).

A frozen worker keeps its connections open and sends nothing. The router must see the silence: streams on it
are cancelled once their stall bound passes and resume on another worker with prompt + tokens so far; its
circuit opens and, its load reports having stopped, it is unroutable until SIGCONT brings them back.
Requests carry a sampling seed, so the sim's tokens depend on (seed, position) only and a migrated request's
tokens must equal an undisturbed run's: none lost, none duplicated.
"""

from __future__ import annotations

import math
import re
import signal
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from functools import partial

import grpc
import httpx
import pytest

from kvmesh.suite.launcher import ServiceProcess
from kvmesh.v1 import common_pb2, router_pb2, router_pb2_grpc
from tests.support.procs import start_together

pytestmark = pytest.mark.fault

N_WORKERS = 3
CLIENTS = 6
MAX_TOKENS = 40
PROMPTS = [[(97 * k + i) % 1000 + 3 for i in range(48)] for k in range(6)]
STOP_S = 10.0


@dataclass
class Done:
    """One client request as the client saw it."""

    prompt: int
    started: float
    ended: float = 0.0
    tokens: list[int] = field(default_factory=list)
    workers: list[str] = field(default_factory=list)
    migrations: int = 0
    error: str = ""


def request(k: int) -> router_pb2.RouterServiceGenerateRequest:
    sp = common_pb2.SamplingParams(max_tokens=MAX_TOKENS, ignore_eos=True, seed=1000 + k)
    return router_pb2.RouterServiceGenerateRequest(token_ids=common_pb2.TokenIds(ids=PROMPTS[k]), sampling=sp)


def run_one(stub: router_pb2_grpc.RouterServiceStub, k: int, out: list[Done] | None = None) -> Done:
    """Streams request `k`; `out` gets it at once (its tokens as they come: the test watches them)."""
    d = Done(k, time.monotonic())
    if out is not None:
        out.append(d)
    try:
        for m in stub.Generate(request(k), timeout=30):
            d.tokens += m.token_ids
            if m.token_ids:
                d.workers.append(m.worker_id)
            d.migrations = m.migrations
    except grpc.RpcError as e:
        d.error = f"{e.code().name}: {e.details()}"
    d.ended = time.monotonic()
    return d


def client(address: str, first: int, stop: threading.Event, out: list[Done]) -> None:
    with grpc.insecure_channel(address) as ch:
        stub = router_pb2_grpc.RouterServiceStub(ch)
        for i in range(10_000):  # bounded; ends when `stop` is set
            if stop.is_set():
                return
            run_one(stub, (first + i) % len(PROMPTS), out)


def listed(router: ServiceProcess) -> dict[str, router_pb2.WorkerStatus]:
    with grpc.insecure_channel(router.address) as ch:
        resp = router_pb2_grpc.RouterAdminServiceStub(ch).ListWorkers(router_pb2.ListWorkersRequest(), timeout=10)
    return {w.endpoint.address: w for w in resp.workers}


def metric(router: ServiceProcess, name: str) -> float:
    text = httpx.get(f"http://127.0.0.1:{router.http_port}/metrics", timeout=10).text
    m = re.search(rf"^{re.escape(name)} (\S+)$", text, re.M)
    return float(m.group(1)) if m else 0.0


def routable(router: ServiceProcess) -> float:
    return metric(router, "kvmesh_router_workers_routable")


def out_of_rotation(w: router_pb2.WorkerStatus) -> bool:
    return w.endpoint.health != common_pb2.HEALTH_STATE_PASSING or w.circuit == "open"


def wait_for(cond: Callable[[], bool], timeout_s: float) -> bool:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:  # bounded polling, each probe is an RPC or a scrape
        if cond():
            return True
    return cond()


def p99(xs: list[float]) -> float:
    s = sorted(xs)
    return s[max(math.ceil(0.99 * len(s)) - 1, 0)] if s else 0.0


@pytest.mark.parametrize("hedge", ["false", "true"])
def test_a_frozen_worker_never_stalls_a_stream(hedge: str, services: Callable[..., ServiceProcess]) -> None:
    sim = ("--engine", "sim", "--sim-speed", "1", "--block-size", "16", "--kv-blocks", "4096")
    workers = start_together(*[partial(services, "worker", *sim)] * N_WORKERS)
    addresses = ",".join(w.address for w in workers)
    router = services("router", "--workers", addresses, "--block-size", "16", "--hedge-first-token", hedge)
    assert wait_for(lambda: routable(router) == N_WORKERS, 20)
    with grpc.insecure_channel(router.address) as ch:  # the undisturbed tokens; also warms the latency EWMAs
        stub = router_pb2_grpc.RouterServiceStub(ch)
        truth = {}
        for k in range(len(PROMPTS)):
            d = run_one(stub, k)
            assert not d.error and len(d.tokens) == MAX_TOKENS
            truth[k] = d.tokens
    frozen = workers[0]
    fid = listed(router)[frozen.address].endpoint.id
    stop = threading.Event()
    done: list[Done] = []
    threads = [threading.Thread(target=client, args=(router.address, i, stop, done)) for i in range(CLIENTS)]
    for t in threads:
        t.start()
    try:
        streaming = lambda: any(not d.ended and len(d.workers) >= 5 and d.workers[-1] == fid for d in done)  # noqa: E731
        assert wait_for(streaming, 20), "no request streams from the worker"
        t_stop = time.monotonic()
        frozen.proc.send_signal(signal.SIGSTOP)
        # within the stall ceiling (5 s) and a check or two
        assert wait_for(lambda: out_of_rotation(listed(router)[frozen.address]), 8), "still in rotation"
        t_out = time.monotonic() - t_stop
        assert routable(router) == N_WORKERS - 1
        stayed_out = True
        while time.monotonic() < t_stop + STOP_S:  # bounded by STOP_S: the freeze lasts that long
            stayed_out = stayed_out and out_of_rotation(listed(router)[frozen.address])
        frozen.proc.send_signal(signal.SIGCONT)
        t_cont = time.monotonic()
        assert stayed_out, "the frozen worker came back into rotation while frozen"
        back = wait_for(
            lambda: routable(router) == N_WORKERS and not out_of_rotation(listed(router)[frozen.address]), 20
        )
        t_back = time.monotonic() - t_cont
        assert back, "the worker is not back in rotation after SIGCONT"
        n_before = len(done)
        assert wait_for(lambda: any(fid in d.workers for d in done[n_before:]), 20), "never routed to again"
    finally:
        frozen.proc.send_signal(signal.SIGCONT)
        stop.set()
        for t in threads:
            t.join(timeout=60)
    assert not any(t.is_alive() for t in threads)
    errors = [d.error for d in done if d.error]
    assert not errors, errors[:3]
    wrong = [d for d in done if d.tokens != truth[d.prompt]]
    assert not wrong, f"{len(wrong)} requests with lost or duplicated tokens"
    during = [d for d in done if d.started < t_cont and d.ended > t_stop]
    on_frozen = [d for d in during if fid in d.workers and d.migrations > 0]
    lat = [d.ended - d.started for d in on_frozen]
    lat_during = [d.ended - d.started for d in during]
    print(
        f"hedge={hedge} requests={len(done)} during_stop={len(during)} migrated_off_frozen={len(on_frozen)} "
        f"p99_on_frozen={p99(lat):.2f}s max_on_frozen={max(lat, default=0):.2f}s "
        f"p99_during_stop={p99(lat_during):.2f}s out_of_rotation_after={t_out:.2f}s back_after_cont={t_back:.2f}s"
    )
    assert on_frozen, "no request was migrated off the frozen worker"
    assert metric(router, "kvmesh_router_stalls_total") >= len(on_frozen)
    # Whether a hedge wins here depends on timing (a request must be waiting for its first token on the worker
    # when it freezes; under load they are all mid-stream at times): hedging is shown in the core driver's
    # tests; here, that with it on, as off, the freeze loses and duplicates nothing and stays under the bound.
    # No request waits out the freeze. The stall bound adapts to the worker's own token gaps (10x, within
    # 1-5 s), so the latency is a figure of the machine's load (printed above; 1.8-2.2 s on a quiet machine,
    # 5.7 s with both cores busy under a CI run and stress): the bound asserted is the freeze's, not a speed.
    assert p99(lat) < 0.8 * STOP_S
    assert p99(lat_during) < 0.8 * STOP_S
