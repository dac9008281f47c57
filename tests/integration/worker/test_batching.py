"""The worker's batching window (`--batching-window-ms`, `kvmesh.services.worker.admission`).

In-process: the servicer over a real sim engine, the gate's timer replaced by a manual one (no sleeps, no
timing): requests submitted inside one window wait, then enter the engine shortest prompt first when the
window closes; one cancelled while waiting never reaches the engine; a full window is RESOURCE_EXHAUSTED;
with the window off requests enter in submission order. A worker process started with the flag serves gRPC
and OpenAI requests through it and exports the window's metrics; a negative window stops it at start, naming the field.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Callable
from pathlib import Path

import grpc
import httpx
import pytest
from prometheus_client import REGISTRY

from kvmesh.core.errors import ResourceExhausted
from kvmesh.core.generation import EngineRequest
from kvmesh.engine.sim.driver import SimEngine
from kvmesh.services.worker.admission import WindowGate, window_config
from kvmesh.services.worker.app import WorkerApp
from kvmesh.services.worker.engine_factory import build_engine
from kvmesh.services.worker.servicer import WorkerServicer
from kvmesh.services.worker.settings import WorkerSettings
from kvmesh.suite.launcher import start_service
from kvmesh.v1 import worker_pb2, worker_pb2_grpc
from tests.support.sim_worker import gen_req

pytestmark = pytest.mark.integration
LENGTHS = {"a": 300, "b": 100, "c": 200}  # request id -> prompt tokens, submitted in this order


class ManualTimer:
    """Stands in for `loop.call_at`: records the callback; the test fires it."""

    class Handle:
        def __init__(self) -> None:
            self.cancelled = False

        def cancel(self) -> None:
            self.cancelled = True

    def __init__(self) -> None:
        self.armed: list[tuple[float, Callable[[], None], ManualTimer.Handle]] = []

    def schedule(self, when: float, cb: Callable[[], None]) -> ManualTimer.Handle:
        h = ManualTimer.Handle()
        self.armed.append((when, cb, h))
        return h

    def fire(self) -> None:
        live = [(w, cb) for w, cb, h in self.armed if not h.cancelled]
        assert len(live) == 1, live
        self.armed.clear()
        live[0][1]()


class Worker:
    def __init__(self, servicer: WorkerServicer, engine: SimEngine, timer: ManualTimer) -> None:
        self.servicer, self.engine, self.timer = servicer, engine, timer
        self.entered: list[str] = []
        add = engine.core.add_request

        def spy(req: EngineRequest, now: float) -> None:
            self.entered.append(req.request_id)
            add(req, now)

        engine.core.add_request = spy  # type: ignore[method-assign]

    def start(self, rid: str) -> asyncio.Task[list[worker_pb2.GenerateResponse]]:
        async def run() -> list[worker_pb2.GenerateResponse]:
            ids = list(range(1, 1 + LENGTHS[rid]))
            return [m async for m in self.servicer.outputs(gen_req(rid, ids, max_tokens=3))]

        return asyncio.create_task(run())

    async def until_waiting(self, n: int) -> None:
        """Yield to the loop (bounded) until `n` requests wait in the window."""
        gate = self.servicer.app.gate
        assert gate is not None
        for _ in range(200):
            if len(gate.window) == n:
                return
            await asyncio.sleep(0)
        raise AssertionError(f"{len(gate.window)} waiting, expected {n}")


async def make_worker(window_ms: float, **kw: object) -> AsyncIterator[Worker]:
    settings = WorkerSettings(
        engine="sim", block_size=16, kv_blocks=512, sim_speed=0, cpu_tier_mb=0, batching_window_ms=window_ms, **kw
    )  # type: ignore[arg-type]
    engine = build_engine(settings)
    assert isinstance(engine, SimEngine)
    await engine.start()
    app = WorkerApp(engine, "sim", "worker-b")
    timer = ManualTimer()
    cfg = window_config(settings)
    app.gate = WindowGate(cfg, clock=lambda: 0.0, schedule=timer.schedule) if cfg is not None else None
    try:
        yield Worker(WorkerServicer(app, settings), engine, timer)
    finally:
        await engine.stop()


@pytest.fixture
async def windowed() -> AsyncIterator[Worker]:
    async for w in make_worker(50.0):
        yield w


@pytest.fixture
async def unwindowed() -> AsyncIterator[Worker]:
    async for w in make_worker(0.0):
        yield w


def sample(name: str) -> float:
    return REGISTRY.get_sample_value(name) or 0.0


async def test_requests_in_one_window_enter_shortest_first(windowed: Worker) -> None:
    releases = sample("kvmesh_worker_batching_release_requests_count")
    waits = sample("kvmesh_worker_batching_wait_seconds_count")
    tasks = [windowed.start(rid) for rid in LENGTHS]
    await windowed.until_waiting(3)
    assert windowed.entered == []  # all three wait in the window
    assert windowed.servicer.app.load().waiting == 3  # and the load report says so
    windowed.timer.fire()
    outs = await asyncio.gather(*tasks)
    assert windowed.entered == ["b", "c", "a"]  # 100, 200, 300 prompt tokens
    assert all(o[-1].usage.completion_tokens == 3 for o in outs)
    assert sample("kvmesh_worker_batching_release_requests_count") == releases + 1
    assert sample("kvmesh_worker_batching_wait_seconds_count") == waits + 3


async def test_without_the_window_requests_enter_in_submission_order(unwindowed: Worker) -> None:
    assert unwindowed.servicer.app.gate is None
    outs = await asyncio.gather(*(unwindowed.start(rid) for rid in LENGTHS))
    assert unwindowed.entered == ["a", "b", "c"]
    assert all(o[-1].usage.completion_tokens == 3 for o in outs)


async def test_a_request_cancelled_while_waiting_never_enters_the_engine(windowed: Worker) -> None:
    keep, gone = windowed.start("a"), windowed.start("b")
    await windowed.until_waiting(2)
    gone.cancel()
    with pytest.raises(asyncio.CancelledError):
        await gone
    await windowed.until_waiting(1)
    windowed.timer.fire()
    out = await keep
    assert windowed.entered == ["a"] and out[-1].usage.completion_tokens == 3


async def test_a_full_window_is_resource_exhausted() -> None:
    async for w in make_worker(50.0, max_queue=1):
        first = w.start("a")
        await w.until_waiting(1)
        with pytest.raises(ResourceExhausted, match="batching window full"):
            await w.start("b")
        w.timer.fire()
        assert (await first)[-1].usage.completion_tokens == 3
        assert w.entered == ["a"]


SIM = ("--engine", "sim", "--kv-blocks", "256", "--block-size", "16", "--cpu-tier-mb", "0", "--sim-speed", "20")


async def test_a_worker_process_serves_through_the_window(tmp_path: Path) -> None:
    sp = start_service("worker", tmp_path, *SIM, "--batching-window-ms", "50", timeout=60)
    try:
        async with grpc.aio.insecure_channel(sp.address) as ch:
            stub = worker_pb2_grpc.WorkerServiceStub(ch)

            async def one(rid: str) -> list[worker_pb2.GenerateResponse]:
                ids = list(range(1, 1 + LENGTHS[rid]))
                return [m async for m in stub.Generate(gen_req(rid, ids, max_tokens=4), timeout=30)]

            outs = await asyncio.gather(*(one(rid) for rid in LENGTHS))
        body = {"model": "m", "prompt": "through the window", "max_tokens": 2}
        http = httpx.post(f"http://127.0.0.1:{sp.http_port}/v1/completions", json=body, timeout=30)
        text = httpx.get(f"http://127.0.0.1:{sp.http_port}/metrics", timeout=10).text
    finally:
        assert sp.terminate(timeout=30) == 0
    assert all(o[-1].usage.completion_tokens == 4 for o in outs)
    assert http.status_code == 200 and http.json()["usage"]["completion_tokens"] == 2  # the OpenAI route too
    assert "kvmesh_worker_batching_wait_seconds_count 4.0" in text.splitlines()
    assert "kvmesh_worker_batching_release_requests_count" in text


def test_a_negative_window_stops_the_worker_at_start(tmp_path: Path) -> None:
    with pytest.raises(RuntimeError, match=r"window_s: must be > 0"):
        start_service("worker", tmp_path, *SIM, "--batching-window-ms", "-5", timeout=30)
