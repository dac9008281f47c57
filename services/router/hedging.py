"""Hedging a request's first token (`StallConfig.hedge`): a first attempt whose first token is later than its
stall bound also goes to a second worker; the first of the two to send a step streams, the other is
cancelled (`kvmesh_router_hedges_total`, by winner).

A racer that loses is a breaker success of 0 ms (it did nothing wrong, its slot is freed); one that fails, or
a primary still silent when the hedge answers, trips its worker's breaker (a stall is counted). With no
worker to hedge to the primary is waited for (a late answer beats none); when neither racer answers within
its bound the attempt stalls, and the request path retries it elsewhere.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Awaitable, Callable

import grpc

from kvmesh.core.errors import KvmeshError
from kvmesh.routing import InflightTracker
from kvmesh.services.router import metrics as m
from kvmesh.services.router.attempt import Attempt
from kvmesh.services.router.worker_stream import close_call
from kvmesh.services.router.workers import WorkerPool
from kvmesh.v1 import worker_pb2

Step = asyncio.Future[worker_pb2.GenerateResponse]
Dispatch = Callable[[set[str]], Awaitable[Attempt]]  # the attempt routed to a worker outside the set, not sent


def _next(a: Attempt) -> Step:
    """The attempt's next step, as a future a race can wait on."""
    return asyncio.ensure_future(anext(a.it))


class Hedging:
    """Runs first-token races for the request path: the pool (breakers), the in-flight tracker (the winner's
    assignment) and the pair's bound once a hedge is out (`ceiling_s`: a busy pair is waited for)."""

    def __init__(self, pool: WorkerPool, tracker: InflightTracker, block_size: int, ceiling_s: float) -> None:
        self.pool, self.tracker, self.block_size, self.ceiling_s = pool, tracker, block_size, ceiling_s

    async def steps(
        self, cur: Attempt, exclude: set[str], dispatch: Dispatch, carrier: dict[str, str]
    ) -> AsyncIterator[worker_pb2.GenerateResponse]:
        """`cur`'s steps (`cur` already sent), its first one raced: when it is later than `cur`'s stall bound,
        the same attempt goes to a second worker too (`dispatch`, outside `exclude` and `cur`'s worker), and
        the first of the two to send a step wins; the other is cancelled (a late primary counts as stalled).
        `cur` is updated in place to the winner. With no worker to hedge to, `cur` is waited for. Raises
        TimeoutError when neither racer answers within its bound (a stall of `cur`)."""
        racers: dict[Step, Attempt] = {_next(cur): cur}
        deadline: float | None = time.monotonic() + cur.watch.bound
        sent_hedge = False
        try:
            for _ in range(4):  # each pass ends the race, drops a racer or adds the one hedge
                left = None if deadline is None else max(deadline - time.monotonic(), 0.0)
                done, _ = await asyncio.wait(racers, timeout=left, return_when=asyncio.FIRST_COMPLETED)
                won = next((t for t in done if t.exception() is None), None)
                if won is not None:
                    self._won(cur, racers.pop(won), racers)
                    first = won.result()
                    break
                if done:  # a racer failed or ended: the other goes on; the last one's error is the attempt's
                    t = next(iter(done))
                    lost = racers.pop(t)
                    if not racers:
                        cur.take(lost)
                        first = t.result()  # raises
                    self._abandon(lost, exclude, trip=f"failed while racing: {t.exception()!r}")
                    continue
                if not sent_hedge:
                    sent_hedge = True
                    second = await self._hedge(exclude | {cur.wid}, dispatch, carrier)
                    if second is not None:
                        racers[_next(second)] = second
                        deadline = time.monotonic() + self.ceiling_s  # a busy pair is waited for
                    else:  # nowhere to hedge to: a late answer beats none (its call keeps its own deadline)
                        deadline = None
                    continue
                break
            else:
                raise AssertionError("unreachable: the race has at most 4 passes")
            if won is None:  # neither answered in time: the attempt stalls
                self._stall(cur, racers, exclude)
                raise TimeoutError
        except StopAsyncIteration:
            return
        finally:  # a cancelled request (client gone) leaves no racer behind
            for t, a in racers.items():
                t.cancel()
                if a is not cur:
                    close_call(a.call, False)
        yield first
        async for step in cur.it:
            yield step

    async def _hedge(self, exclude: set[str], dispatch: Dispatch, carrier: dict[str, str]) -> Attempt | None:
        """The hedge attempt on another worker, sent; None when no other worker can take it."""
        try:
            a = await dispatch(exclude)
        except KvmeshError:
            return None
        a.hedge = True
        try:
            await a.send(carrier)
        except grpc.aio.AioRpcError as e:
            self._abandon(a, exclude, trip=f"hedge not sent: {e.code().name}")
            return None
        return a

    def _won(self, cur: Attempt, winner: Attempt, losers: dict[Step, Attempt]) -> None:
        """`winner` sent the first step: the losers are cancelled and `cur` becomes the winner."""
        if not winner.hedge and not losers:
            return  # no race was run: the primary answered in time
        m.HEDGES.labels("hedge" if winner.hedge else "primary").inc()
        for t, lost in list(losers.items()):
            t.cancel()
            self._abandon(lost, set(), stalled=not lost.hedge and lost.watch.silent(time.monotonic()))
        losers.clear()
        now = time.monotonic()
        self.tracker.assign(cur.request_id, winner.wid, winner.n_new, winner.kv_tokens, self.block_size, now)
        if winner is not cur:
            cur.take(winner)

    def _stall(self, cur: Attempt, racers: dict[Step, Attempt], exclude: set[str]) -> None:
        """Neither racer answered within its bound: one stays the attempt (it ends Stalled), the others are
        cancelled as stalled too."""
        keep = cur if any(a is cur for a in racers.values()) else next(iter(racers.values()))
        for t, a in list(racers.items()):
            t.cancel()
            if a is not keep:
                self._abandon(a, exclude, stalled=True)
        racers.clear()
        if keep is not cur:
            cur.take(keep)

    def _abandon(self, a: Attempt, exclude: set[str], stalled: bool = False, trip: str = "") -> None:
        """Cancels a racer's call and excludes its worker: a stalled or failed one trips the worker's breaker
        (a stall is counted), one that merely lost frees its breaker slot (a 0 ms success sample)."""
        close_call(a.call, False)
        now = time.monotonic()
        exclude.add(a.wid)
        if stalled:
            m.STALLS.inc()
            trip = a.watch.detail(a.wid)
        if trip:
            self.pool.mark_failed(a.wid, now, trip)
        else:
            a.h.breaker.record(now, 0.0, True)
