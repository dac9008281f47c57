"""`RouterCore`'s request path as a driver of `kvmesh.routing.attempts`, against scripted in-process worker
calls (no processes): a migration resumes with prompt + tokens so far, a finished call gets its trailers grace,
a failed worker's breaker trips, a client error fails at once."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass, field
from typing import Any, cast

import grpc
import pytest
from prometheus_client import REGISTRY

from kvmesh.core.errors import InvalidArgument, Unavailable
from kvmesh.core.generation import SamplingParams
from kvmesh.replica.media import PrefixMatches
from kvmesh.routing import Admission, CircuitBreaker, CircuitState, InflightTracker, Profile, QueueLimits, WorkerView
from kvmesh.routing.stall import StallConfig
from kvmesh.services.router.core import RouterCore
from kvmesh.services.router.index_replica import IndexReplica
from kvmesh.services.router.limits import CoreLimits
from kvmesh.services.router.request import RouterRequest
from kvmesh.services.router.stream_requests import rpc_error
from kvmesh.services.router.workers import WorkerPool
from kvmesh.v1 import common_pb2, worker_pb2

pytestmark = pytest.mark.unit

PROMPT = list(range(1, 41))


class ScriptedCall:
    """A worker call that yields `steps`, then raises `error` (if any) or ends."""

    def __init__(self, steps: list[worker_pb2.GenerateResponse], error: grpc.aio.AioRpcError | None) -> None:
        self.steps, self.error = steps, error
        self.was_cancelled = False
        self._ended = False

    def __aiter__(self) -> AsyncIterator[worker_pb2.GenerateResponse]:
        return self._run()

    async def _run(self) -> AsyncIterator[worker_pb2.GenerateResponse]:
        for s in self.steps:
            yield s
        if self.error is not None:
            self._ended = True
            raise self.error

    def done(self) -> bool:  # a finished call's trailers are still on their way
        return self._ended

    def cancelled(self) -> bool:
        return self.was_cancelled

    def cancel(self) -> bool:
        self.was_cancelled = True
        return True


class FrozenCall(ScriptedCall):
    """A worker call that yields `steps`, then nothing more while its connection stays open (SIGSTOP), or
    `gap_s` later the next step of `later` (a slow worker, not a frozen one)."""

    def __init__(
        self, steps: list[worker_pb2.GenerateResponse], later: Sequence[worker_pb2.GenerateResponse] = ()
    ) -> None:
        super().__init__(steps, None)
        self.later = later

    async def _run(self) -> AsyncIterator[worker_pb2.GenerateResponse]:
        for s in self.steps:
            yield s
        for s in self.later:
            await asyncio.sleep(0.2)
            yield s
        await asyncio.Event().wait()


@dataclass
class FakeHandle:
    wid: str
    scripts: list[ScriptedCall]
    sent: list[worker_pb2.GenerateRequest]
    breaker: CircuitBreaker = field(default_factory=CircuitBreaker)
    selections_total: int = 0
    last_report_rx: float = float("-inf")  # no load reports: only its streams show it alive
    view: WorkerView = field(init=False)

    def __post_init__(self) -> None:
        self.view = WorkerView(id=self.wid, kv_blocks_total=100000)

    async def generate(
        self, rid: str, request_bytes: bytes, carrier: dict[str, str], sequences: int = 1
    ) -> ScriptedCall:
        self.sent.append(worker_pb2.GenerateRequest.FromString(request_bytes))
        return self.scripts.pop(0)


class FakePool:
    """Two workers sharing one script of calls: the n-th attempt, wherever it goes, gets the n-th call."""

    def __init__(self, scripts: list[ScriptedCall]) -> None:
        self.sent: list[worker_pb2.GenerateRequest] = []
        self.by_id = {w: FakeHandle(w, scripts, self.sent) for w in ("w0", "w1")}
        self.failed: list[str] = []

    async def settle(self) -> None:  # every worker known from the start
        return None

    def views(self, now: float) -> list[WorkerView]:
        for h in self.by_id.values():
            h.view.circuit = h.breaker.view_state(now)
        return [h.view for h in self.by_id.values()]

    def mark_failed(self, worker_id: str, now: float, reason: str) -> None:
        self.failed.append(worker_id)
        self.by_id[worker_id].breaker.force_open(now, reason)


class NoIndex:
    async def lookup(self, hashes: Any, tenant: str = "", lora: str = "", token_ids: Any = None) -> PrefixMatches:
        return PrefixMatches()


def step(ids: list[int], finish: int = 0) -> worker_pb2.GenerateResponse:
    return worker_pb2.GenerateResponse(token_ids=ids, text="t" * len(ids), finish_reason=finish)


LIMITS = CoreLimits(block_size=16, max_retries=1, max_migrations=1)


def core_for(pool: FakePool, stall: StallConfig | None = None) -> RouterCore:
    admission = Admission(short=QueueLimits(4, 4), long=QueueLimits(4, 4))
    return RouterCore(
        Profile.default(seed=1),
        cast(WorkerPool, pool),
        cast(IndexReplica, NoIndex()),
        InflightTracker(),
        admission,
        LIMITS,
        stall=stall,
    )


def request(max_tokens: int = 10, min_tokens: int = 5, resume: list[int] | None = None) -> RouterRequest:
    sampling = SamplingParams(max_tokens=max_tokens, min_tokens=min_tokens, seed=3, temperature=0.5)
    return RouterRequest.checked(LIMITS, "r1", PROMPT, sampling, resume_ids=resume or [])


def counter(name: str) -> float:
    return REGISTRY.get_sample_value(name) or 0.0


async def test_a_migration_resumes_on_the_other_worker_with_the_tokens_so_far() -> None:
    broken = ScriptedCall([step([7]), step([8, 9])], rpc_error(grpc.StatusCode.UNAVAILABLE, "died"))
    finish = ScriptedCall([step([10], finish=common_pb2.FINISH_REASON_STOP)], None)
    pool = FakePool([broken, finish])
    migrations = counter("kvmesh_migrations_total")
    chunks = [c async for c in core_for(pool).generate(request())]
    assert [t for c in chunks for t in c.token_ids] == [7, 8, 9, 10]
    last = chunks[-1]
    assert last.finish_reason == common_pb2.FINISH_REASON_STOP and last.migrations == 1
    assert last.usage is not None and last.usage.completion_tokens == 4 and last.usage.prompt_tokens == len(PROMPT)
    first, resumed = pool.sent
    assert list(first.token_ids.ids) == PROMPT and (first.sampling.max_tokens, first.sampling.min_tokens) == (10, 5)
    assert list(resumed.token_ids.ids) == [*PROMPT, 7, 8, 9]
    assert (resumed.sampling.max_tokens, resumed.sampling.min_tokens) == (7, 2)
    assert [(r.sampling.seed, r.sampling.temperature) for r in pool.sent] == [(3, 0.5)] * 2  # domain → wire
    assert chunks[0].worker_id != last.worker_id and pool.failed == [chunks[0].worker_id]
    assert pool.by_id[chunks[0].worker_id].breaker.current(0.0) is not CircuitState.CLOSED
    assert counter("kvmesh_migrations_total") == migrations + 1
    assert not finish.was_cancelled  # finished: its trailers get a grace period, no abort


async def test_resume_ids_count_toward_max_tokens_and_length_ends_without_a_worker() -> None:
    pool = FakePool([])
    chunks = [c async for c in core_for(pool).generate(request(max_tokens=3, resume=[5, 6, 7]))]
    assert len(chunks) == 1 and chunks[0].finish_reason == common_pb2.FINISH_REASON_LENGTH
    # the resumed ids count toward max_tokens but are not generated ones (the input-hardening work: usage was forgeable)
    assert chunks[0].usage is not None and chunks[0].usage.completion_tokens == 0
    assert pool.sent == []


async def test_a_retry_before_the_first_token_then_over_budget_fails_unavailable() -> None:
    calls = [ScriptedCall([], rpc_error(grpc.StatusCode.UNAVAILABLE, f"down {i}")) for i in range(2)]
    pool = FakePool(calls)
    retries = counter("kvmesh_retries_total")
    with pytest.raises(Unavailable, match="failed on 2 workers"):
        _ = [c async for c in core_for(pool).generate(request())]
    assert counter("kvmesh_retries_total") == retries + 2  # the over-budget retry is counted too
    assert sorted(pool.failed) == ["w0", "w1"]


async def test_a_client_error_fails_at_once_without_touching_the_breaker() -> None:
    pool = FakePool([ScriptedCall([], rpc_error(grpc.StatusCode.INVALID_ARGUMENT, "bad seed"))])
    with pytest.raises(InvalidArgument, match="worker rejected the request"):
        _ = [c async for c in core_for(pool).generate(request())]
    assert pool.failed == [] and len(pool.sent) == 1


async def test_closing_the_stream_early_cancels_the_worker_call() -> None:
    # the attempts loop itself: `generate`'s inner generator is closed by the event loop's finaliser, later
    call = ScriptedCall([step([7]), step([8]), step([9], finish=common_pb2.FINISH_REASON_STOP)], None)
    gen = core_for(FakePool([call]))._run(request(), time.monotonic())
    first = await gen.__anext__()
    assert first.token_ids == [7]
    await gen.aclose()
    assert call.was_cancelled


FAST = StallConfig(itl_floor_s=0.05, itl_ceiling_s=0.05, ttft_floor_s=0.05, ttft_ceiling_s=0.05)


async def collect(core: RouterCore, req: RouterRequest) -> list[Any]:
    return await asyncio.wait_for(_collect(core, req), 10)  # a stall not seen fails here instead of hanging


async def _collect(core: RouterCore, req: RouterRequest) -> list[Any]:
    return [c async for c in core.generate(req)]


async def test_a_stalled_stream_migrates_with_the_tokens_so_far_and_trips_the_breaker() -> None:
    frozen = FrozenCall([step([7]), step([8, 9])])
    finish = ScriptedCall([step([10], finish=common_pb2.FINISH_REASON_STOP)], None)
    pool = FakePool([frozen, finish])
    stalls, migrations = counter("kvmesh_router_stalls_total"), counter("kvmesh_migrations_total")
    chunks = await collect(core_for(pool, FAST), request())
    assert [t for c in chunks for t in c.token_ids] == [7, 8, 9, 10]
    assert chunks[-1].migrations == 1 and chunks[-1].worker_id != chunks[0].worker_id
    assert list(pool.sent[1].token_ids.ids) == [*PROMPT, 7, 8, 9]
    assert frozen.was_cancelled  # the frozen worker is told to abort (it hears it once it runs again)
    assert pool.failed == [chunks[0].worker_id]
    assert pool.by_id[chunks[0].worker_id].breaker.current(time.monotonic()) is CircuitState.OPEN
    assert counter("kvmesh_router_stalls_total") == stalls + 1
    assert counter("kvmesh_migrations_total") == migrations + 1


async def test_a_first_token_that_never_comes_is_a_retry_elsewhere() -> None:
    frozen = FrozenCall([])
    finish = ScriptedCall([step([7, 8], finish=common_pb2.FINISH_REASON_STOP)], None)
    pool = FakePool([frozen, finish])
    retries = counter("kvmesh_retries_total")
    chunks = await collect(core_for(pool, FAST), request())
    assert [t for c in chunks for t in c.token_ids] == [7, 8] and chunks[-1].migrations == 0
    assert [list(r.token_ids.ids) for r in pool.sent] == [PROMPT, PROMPT]
    assert frozen.was_cancelled and len(pool.failed) == 1
    assert counter("kvmesh_retries_total") == retries + 1


async def test_without_stall_detection_a_slow_stream_is_waited_for() -> None:
    slow = FrozenCall([step([7])], later=[step([8], finish=common_pb2.FINISH_REASON_STOP)])
    pool = FakePool([slow])
    chunks = await collect(core_for(pool, StallConfig(enabled=False)), request())
    assert [t for c in chunks for t in c.token_ids] == [7, 8] and pool.failed == [] and len(pool.sent) == 1


async def test_the_stall_bound_follows_the_workers_own_gaps() -> None:
    # a worker whose gaps are 0.2 s gets 10 x 0.2 = 2 s (within [0.05, 5]): its 0.2 s gap is no stall
    cfg = StallConfig(itl_floor_s=0.05, itl_ceiling_s=5.0, ttft_floor_s=0.05, ttft_ceiling_s=5.0)
    steps = [step([8]), step([9]), step([10], finish=common_pb2.FINISH_REASON_STOP)]
    pool = FakePool([FrozenCall([step([7])], later=steps)])
    core = core_for(pool, cfg)
    chunks = await collect(core, request())
    assert [t for c in chunks for t in c.token_ids] == [7, 8, 9, 10] and pool.failed == []
    (lat,) = core.latency.values()
    assert 0.3 < lat.itl_bound(cfg) < 5.0


HEDGE = StallConfig(itl_floor_s=0.05, itl_ceiling_s=0.05, ttft_floor_s=0.05, ttft_ceiling_s=0.05, hedge=True)


def hedges(winner: str) -> float:
    return counter_labelled("kvmesh_router_hedges_total", winner)


def counter_labelled(name: str, winner: str) -> float:
    return REGISTRY.get_sample_value(name, {"winner": winner}) or 0.0


async def test_a_late_first_token_is_hedged_and_the_hedge_that_answers_wins_alone() -> None:
    frozen = FrozenCall([], later=[step([99])] * 3)  # answers, but only after the hedge has: never streamed
    hedge = ScriptedCall([step([7]), step([8], finish=common_pb2.FINISH_REASON_STOP)], None)
    pool = FakePool([frozen, hedge])
    won = hedges("hedge")
    chunks = await collect(core_for(pool, HEDGE), request())
    assert [t for c in chunks for t in c.token_ids] == [7, 8]
    assert {c.worker_id for c in chunks} == {chunks[-1].worker_id} and chunks[-1].migrations == 0
    assert [list(r.token_ids.ids) for r in pool.sent] == [PROMPT, PROMPT]
    assert frozen.was_cancelled and not hedge.was_cancelled
    assert pool.failed == [w for w in pool.by_id if w != chunks[-1].worker_id]  # the late one's circuit opens
    assert hedges("hedge") == won + 1


async def test_a_primary_that_answers_first_wins_and_the_hedge_is_aborted() -> None:
    late = FrozenCall([], later=[step([7]), step([8], finish=common_pb2.FINISH_REASON_STOP)])  # 0.2 s late
    hedge = FrozenCall([])  # the hedge never answers
    pool = FakePool([late, hedge])
    cfg = StallConfig(itl_floor_s=1.0, itl_ceiling_s=1.0, ttft_floor_s=0.1, ttft_ceiling_s=0.1, hedge=True)
    won = hedges("primary")
    chunks = await collect(core_for(pool, cfg), request())
    assert [t for c in chunks for t in c.token_ids] == [7, 8] and len(pool.sent) == 2
    assert hedge.was_cancelled and not late.was_cancelled and pool.failed == []
    assert hedges("primary") == won + 1


async def test_when_neither_racer_answers_the_attempt_stalls_and_retries_elsewhere() -> None:
    primary, second = FrozenCall([]), FrozenCall([])
    pool = FakePool([primary, second, ScriptedCall([step([7], finish=common_pb2.FINISH_REASON_STOP)], None)])
    pool.by_id["w2"] = FakeHandle("w2", pool.by_id["w0"].scripts, pool.sent)
    core = core_for(pool, HEDGE)
    chunks = await collect(core, request())
    assert [t for c in chunks for t in c.token_ids] == [7]
    assert primary.was_cancelled and second.was_cancelled  # both racers late: both stalled, both tripped
    assert len(set(pool.failed)) == 2 and chunks[-1].worker_id not in pool.failed and len(pool.sent) == 3


async def test_a_late_first_token_with_nowhere_to_hedge_to_is_waited_for() -> None:
    late = FrozenCall([], later=[step([7]), step([8], finish=common_pb2.FINISH_REASON_STOP)])  # 0.2 s > 0.05 s
    pool = FakePool([late])
    del pool.by_id["w1"]  # the only worker: a hedge has nowhere to go, and a stall would fail the request
    chunks = await collect(core_for(pool, HEDGE), request())
    assert [t for c in chunks for t in c.token_ids] == [7, 8]
    assert len(pool.sent) == 1 and not late.was_cancelled and pool.failed == []


async def test_a_slow_worker_that_still_reports_is_waited_for_up_to_the_ceiling() -> None:
    # past its 0.05 s bound, but its load reports keep coming (busy, not frozen): no stall before the ceiling
    slow = FrozenCall([], later=[step([7]), step([8], finish=common_pb2.FINISH_REASON_STOP)])
    pool = FakePool([slow])
    for h in pool.by_id.values():
        h.last_report_rx = float("inf")
    cfg = StallConfig(itl_floor_s=0.05, itl_ceiling_s=5.0, ttft_floor_s=0.05, ttft_ceiling_s=5.0)
    chunks = await collect(core_for(pool, cfg), request())
    assert [t for c in chunks for t in c.token_ids] == [7, 8] and pool.failed == [] and len(pool.sent) == 1


async def test_a_reporting_worker_past_the_ceiling_is_a_stall_all_the_same() -> None:
    hung = FrozenCall([])
    finish = ScriptedCall([step([7], finish=common_pb2.FINISH_REASON_STOP)], None)
    pool = FakePool([hung, finish])
    for h in pool.by_id.values():
        h.last_report_rx = float("inf")
    cfg = StallConfig(itl_floor_s=0.05, itl_ceiling_s=0.1, ttft_floor_s=0.05, ttft_ceiling_s=0.1)
    chunks = await collect(core_for(pool, cfg), request())
    assert [t for c in chunks for t in c.token_ids] == [7] and hung.was_cancelled and len(pool.failed) == 1


async def test_a_client_cancel_is_not_mistaken_for_a_stall() -> None:
    frozen = FrozenCall([step([7])])
    pool = FakePool([frozen])
    stalls = counter("kvmesh_router_stalls_total")
    task = asyncio.ensure_future(_collect(core_for(pool, StallConfig()), request()))
    for _ in range(100):  # bounded: until the first token is in
        if pool.sent:
            break
        await asyncio.sleep(0)
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    assert frozen.was_cancelled and pool.failed == [] and counter("kvmesh_router_stalls_total") == stalls
