"""`Hedging.steps`, a first token's race, driven directly: with nowhere to hedge to (or a hedge that cannot be
sent) the late primary is waited for; a racer that fails drops out and trips its worker's breaker while the
other streams."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from typing import Any, cast

import grpc
import pytest

from kvmesh.core.errors import Unavailable
from kvmesh.routing import CircuitBreaker, InflightTracker
from kvmesh.routing.stall import StallConfig, WorkerLatency
from kvmesh.services.router.attempt import Attempt
from kvmesh.services.router.hedging import Hedging
from kvmesh.services.router.stall_watch import StallWatch
from kvmesh.services.router.stream_requests import rpc_error
from kvmesh.services.router.workers import WorkerHandle, WorkerPool
from kvmesh.v1 import worker_pb2

pytestmark = pytest.mark.unit

CFG = StallConfig(ttft_floor_s=0.01, ttft_ceiling_s=0.01)  # a worker without samples: a 10 ms first-token bound


class Call:
    """A worker call: its steps once `go` is set, or `error`; a cancel sets `on_cancel` (when given)."""

    def __init__(
        self,
        steps: list[int],
        go: asyncio.Event,
        error: grpc.aio.AioRpcError | None = None,
        on_cancel: asyncio.Event | None = None,
    ) -> None:
        self.steps, self.go, self.error, self.on_cancel = steps, go, error, on_cancel
        self.was_cancelled = False

    def __aiter__(self) -> AsyncIterator[worker_pb2.GenerateResponse]:
        return self._run()

    async def _run(self) -> AsyncIterator[worker_pb2.GenerateResponse]:
        await self.go.wait()
        if self.error is not None:
            raise self.error
        for t in self.steps:
            yield worker_pb2.GenerateResponse(token_ids=[t])

    def done(self) -> bool:
        return False

    def cancel(self) -> bool:
        self.was_cancelled = True
        if self.on_cancel is not None:
            self.on_cancel.set()
        return True


class Handle:
    def __init__(self, call: Call | None) -> None:
        self.call, self.breaker = call, CircuitBreaker()

    async def generate(self, rid: str, request: bytes, carrier: dict[str, str], sequences: int = 1) -> Call:
        if self.call is None:
            raise rpc_error(grpc.StatusCode.UNAVAILABLE, "connection refused")
        return self.call


class Pool:
    def __init__(self) -> None:
        self.failed: list[tuple[str, str]] = []

    def mark_failed(self, worker_id: str, now: float, reason: str) -> None:
        self.failed.append((worker_id, reason))


def attempt(wid: str, call: Call | None) -> Attempt:
    watch = StallWatch(CFG, WorkerLatency(), 10, lambda: float("-inf"), lambda: True)
    return Attempt("r1", wid, cast(WorkerHandle, Handle(call)), b"", 10, 10, watch)


async def race(cur: Attempt, dispatch: Any, pool: Pool) -> list[int]:
    await cur.send({})
    hedging = Hedging(cast(WorkerPool, pool), InflightTracker(), 16, ceiling_s=5.0)
    steps = hedging.steps(cur, set(), dispatch, {})
    return await asyncio.wait_for(_tokens(steps), 10)  # a race that never ends fails here instead of hanging


async def _tokens(steps: AsyncIterator[worker_pb2.GenerateResponse]) -> list[int]:
    return [t async for s in steps for t in s.token_ids]


async def test_with_nowhere_to_hedge_to_the_late_primary_is_waited_for() -> None:
    late = asyncio.Event()
    tried: list[set[str]] = []

    async def nowhere(exclude: set[str]) -> Attempt:
        tried.append(set(exclude))
        late.set()  # the primary answers only once the hedge was looked for: after its bound
        raise Unavailable("no worker available")

    pool = Pool()
    cur = attempt("w0", Call([7, 8], late))
    assert await race(cur, nowhere, pool) == [7, 8]
    assert tried == [{"w0"}] and pool.failed == [] and cur.wid == "w0"


async def test_a_hedge_that_cannot_be_sent_trips_its_worker_and_the_primary_is_waited_for() -> None:
    late = asyncio.Event()

    async def refused(exclude: set[str]) -> Attempt:
        late.set()
        return attempt("w1", None)  # its worker refuses the connection

    pool = Pool()
    assert await race(attempt("w0", Call([7], late)), refused, pool) == [7]
    assert pool.failed == [("w1", "hedge not sent: UNAVAILABLE")]


async def test_a_primary_failing_while_racing_leaves_the_hedge_to_stream() -> None:
    primary_fails, hedge_answers = asyncio.Event(), asyncio.Event()
    # the hedge answers only once the race has dropped the failed primary (cancelled its call)
    broken = Call([], primary_fails, rpc_error(grpc.StatusCode.INTERNAL, "died"), on_cancel=hedge_answers)
    hedge_call = Call([9], hedge_answers)

    async def second(exclude: set[str]) -> Attempt:
        primary_fails.set()  # the primary dies once the hedge is out
        return attempt("w1", hedge_call)

    pool = Pool()
    cur = attempt("w0", broken)
    assert await race(cur, second, pool) == [9]
    assert cur.wid == "w1" and cur.hedge and not hedge_call.was_cancelled
    assert [w for w, _ in pool.failed] == ["w0"] and "failed while racing" in pool.failed[0][1]
