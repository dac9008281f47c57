"""The router's request path: admit → hash → route → stream, with retries and mid-stream migration.

For one request (token ids already known):

1. admission (`AdmissionGate` over `kvmesh.routing.Admission`): long prompts (> `long_prompt_tokens`) and
   short ones wait in separate bounded queues; a full queue raises RESOURCE_EXHAUSTED with a retry-after;
2. `Placement` hashes the prompt (salted per model, LoRA and tenant) and the routing profile picks a worker
   with the index replica's per-worker overlap;
3. the worker streams tokens; the in-flight tracker and the worker's breaker follow the request; a stream
   that sends nothing for longer than the worker's stall bound (`kvmesh.routing.stall`: its time to first
   token, then between tokens) is cancelled and ends `Stalled` (a frozen worker keeps its connection open);
   with `StallConfig.hedge`, a first attempt whose first token is later than its bound also goes to a second
   worker: the first of the two to send a step streams, the other is cancelled (`kvmesh_router_hedges_total`);
4. when an attempt ends, `kvmesh.routing.attempts` decides: done, a retry elsewhere (no token yet,
   `kvmesh_retries_total`, at most `max_retries`), a migration (prompt + tokens so far and the remaining
   `max_tokens` on another worker, `kvmesh_migrations_total`, at most `max_migrations`) or fail, and what
   the breaker records. The client sees one stream.
5. closing the stream (client cancel) cancels the worker call, which aborts the request on the worker.
"""

from __future__ import annotations

import asyncio
import time
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass, field

import grpc
import numpy as np

from kvmesh.core.errors import InvalidArgument, KvmeshError, Unavailable
from kvmesh.routing import Admission, InflightTracker, Profile
from kvmesh.routing import attempts as at
from kvmesh.routing.dataplane import DEFAULT_PULL_MARGIN
from kvmesh.routing.stall import StallConfig, WorkerLatency
from kvmesh.services.router import metrics as m
from kvmesh.services.router.admission_wait import AdmissionGate
from kvmesh.services.router.index_replica import IndexReplica
from kvmesh.services.router.limits import CoreLimits, check_token_ids
from kvmesh.services.router.observe import StallWatch, StreamClock, record_attempt_end
from kvmesh.services.router.placement import Placement
from kvmesh.services.router.worker_stream import WorkerCall, attempt_request_bytes, classify, close_call
from kvmesh.services.router.workers import WorkerHandle, WorkerPool
from kvmesh.telemetry.tracing import inject
from kvmesh.v1 import common_pb2, worker_pb2


@dataclass(slots=True)
class RouterRequest:
    """A client's request inside the router, after tokenisation (from gRPC or HTTP). `resume_ids`: tokens the
    client already has from a broken stream."""

    request_id: str
    prompt: common_pb2.TokenIds
    sampling: common_pb2.SamplingParams
    session_id: str = ""
    tenant: str = ""
    resume_ids: list[int] = field(default_factory=list)
    lora: str = ""
    prompt_bytes: bytes | None = None  # `prompt`'s wire bytes when the client sent them (forwarded as they are)


@dataclass(slots=True)
class Chunk:
    """One streamed step to the client (`finish_reason`/`usage` on the last one)."""

    token_ids: list[int]
    text: str
    worker_id: str
    migrations: int
    finish_reason: int = common_pb2.FINISH_REASON_UNSPECIFIED
    usage: common_pb2.Usage | None = None


@dataclass(slots=True)
class _Attempt:
    """One attempt of a request on one worker: its request bytes, call, stall watch; `hedge`: a second try
    racing the first for its first token."""

    request_id: str
    wid: str
    h: WorkerHandle
    request: bytes
    n_new: int  # prompt tokens the worker has to compute (not cached there)
    kv_tokens: int
    watch: StallWatch
    call: WorkerCall | None = None
    hedge: bool = False
    _it: AsyncIterator[worker_pb2.GenerateResponse] | None = None

    @property
    def it(self) -> AsyncIterator[worker_pb2.GenerateResponse]:
        """The call's steps (one iterator per attempt: a step read by a racer is not read again)."""
        if self._it is None:
            assert self.call is not None
            self._it = aiter(self.call)
        return self._it

    def take(self, other: _Attempt) -> None:
        """Becomes `other` (a hedge that won)."""
        for name in self.__slots__:
            setattr(self, name, getattr(other, name))


def _next(a: _Attempt) -> asyncio.Future[worker_pb2.GenerateResponse]:
    """The attempt's next step, as a future a race can wait on."""
    return asyncio.ensure_future(anext(a.it))


class RouterCore:
    """Owns the routing profile, the pool, the index replica, the in-flight tracker and admission."""

    def __init__(
        self,
        profile: Profile,
        pool: WorkerPool,
        index: IndexReplica,
        tracker: InflightTracker,
        admission: Admission,
        limits: CoreLimits,
        salt_model: str = "",
        stall: StallConfig | None = None,
        pull_margin: float = DEFAULT_PULL_MARGIN,
    ) -> None:
        self.profile, self.pool, self.index, self.tracker = profile, pool, index, tracker
        self.stall = stall or StallConfig()
        self.latency: dict[str, WorkerLatency] = {}  # per worker id: what its stall bounds derive from
        self.admission, self.limits, self.salt_model = admission, limits, salt_model
        self.gate = AdmissionGate(admission, limits.queue_timeout_s)
        self.placement = Placement(profile, pool, index, tracker, limits.block_size, salt_model, pull_margin)
        m.QUEUES.admission = admission

    def check(self, req: RouterRequest) -> int:
        """Validates sizes and token ids (prompt, stop, resumed: within the vocabulary; the resumed ones at
        most max_tokens); returns the effective max_tokens."""
        lim, n = self.limits, len(req.prompt.ids)
        if n == 0:
            raise InvalidArgument("prompt", "the prompt is empty")
        if n > lim.max_prompt_tokens:
            raise InvalidArgument("prompt", f"{n} tokens > limit {lim.max_prompt_tokens}")
        mt = req.sampling.max_tokens or lim.default_max_tokens
        if mt > lim.max_tokens_limit:
            raise InvalidArgument("max_tokens", f"{mt} > limit {lim.max_tokens_limit}")
        if len(req.resume_ids) > mt:
            raise InvalidArgument("resume_token_ids", f"{len(req.resume_ids)} tokens > max_tokens {mt}")
        check_token_ids(req.prompt.ids, lim.vocab_size, "prompt")
        check_token_ids(req.sampling.stop_token_ids, lim.vocab_size, "stop_token_ids")
        check_token_ids(req.resume_ids, lim.vocab_size, "resume_token_ids")
        return mt

    async def generate(self, req: RouterRequest) -> AsyncIterator[Chunk]:
        """Streams the request's tokens, retrying and migrating across workers as needed."""
        max_tokens = self.check(req)
        rid = req.request_id or uuid.uuid4().hex
        started = time.monotonic()
        await self.gate.admit(rid, len(req.prompt.ids))
        try:
            async for c in self._run(rid, req, max_tokens, started):
                yield c
        finally:
            self.gate.release(rid)

    async def _run(self, rid: str, req: RouterRequest, max_tokens: int, started: float) -> AsyncIterator[Chunk]:
        lim = self.limits
        att = at.Attempts(rid, at.Limits(lim.max_retries, lim.max_migrations, max_tokens), req.resume_ids)
        n_prompt = len(req.prompt.ids)
        prompt_bytes = req.prompt.SerializeToString() if req.prompt_bytes is None else req.prompt_bytes
        exclude: set[str] = set()
        clock = StreamClock(started)
        hedged = False  # only a request's first attempt may race a hedge
        while True:
            plan = att.next_attempt(req.sampling.min_tokens)
            if isinstance(plan, at.LengthReached):
                usage = common_pb2.Usage(prompt_tokens=n_prompt, completion_tokens=att.n_generated)
                yield Chunk([], "", "", att.migrations, common_pb2.FINISH_REASON_LENGTH, usage)
                return
            cur = await self._dispatch(rid, req, plan, att.tokens, prompt_bytes, exclude)
            carrier: dict[str, str] = {}
            inject(carrier)
            clock.new_attempt(time.monotonic())
            outcome: at.Outcome = at.Ended()
            own_error: grpc.aio.AioRpcError | None = None
            hedge = self.stall.hedge and self.stall.enabled and not hedged
            try:
                if not hedge:  # a hedged first token has its own race (`_hedged`)
                    cur.watch.arm()
                await self._send(cur, rid, carrier)
                steps = (
                    self._hedged(cur, rid, req, plan, att.tokens, prompt_bytes, exclude, carrier) if hedge else cur.it
                )
                hedged = hedged or hedge
                async for resp in steps:
                    t = time.monotonic()
                    cur.watch.on_step(t, bool(resp.token_ids))
                    if resp.token_ids:
                        if clock.on_tokens(t):
                            self.tracker.first_token(rid)
                        att.add(resp.token_ids)
                    if resp.finish_reason:
                        outcome = at.Finished(resp.finish_reason, clock.max_gap_ms)
                        self._record(cur.wid, cur.h, att.end(outcome), t)
                        clock.on_finish(t)
                        cached = min(resp.usage.cached_tokens, n_prompt)
                        usage = common_pb2.Usage(
                            prompt_tokens=n_prompt, cached_tokens=cached, completion_tokens=att.n_generated
                        )
                        cur.watch.disarm()
                        yield Chunk(list(resp.token_ids), resp.text, cur.wid, att.migrations, resp.finish_reason, usage)
                        return
                    if resp.token_ids or resp.text:
                        cur.watch.pause()  # the client's pace is no worker's stall
                        yield Chunk(list(resp.token_ids), resp.text, cur.wid, att.migrations)
                    cur.watch.arm()
            except asyncio.CancelledError:
                if not cur.watch.stalled():
                    raise
                outcome = at.Stalled(cur.watch.detail(cur.wid))
            except TimeoutError:  # a hedged race that neither racer answered
                outcome = at.Stalled(cur.watch.detail(cur.wid))
            except grpc.aio.AioRpcError as e:
                outcome, own_error = at.Failed(classify(e, cur.call), f"{e.code().name}: {e.details()}"), e
            finally:
                cur.watch.disarm()
                close_call(cur.call, isinstance(outcome, at.Finished))
                self.tracker.finish(rid)
            d = att.end(outcome)
            self._record(cur.wid, cur.h, d, time.monotonic())
            exclude.add(cur.wid)
            record_attempt_end(rid, cur.wid, d, len(att.tokens), isinstance(outcome, at.Stalled))
            if d.action is at.Action.FAIL:
                raise d.error or own_error or Unavailable(d.reason)

    async def _send(self, a: _Attempt, rid: str, carrier: dict[str, str]) -> None:
        """Sends the attempt's request to its worker."""
        a.call = await a.h.generate(rid, a.request, carrier)
        a.watch.sent(time.monotonic())

    async def _hedged(
        self,
        cur: _Attempt,
        rid: str,
        req: RouterRequest,
        plan: at.NextAttempt,
        so_far: list[int],
        prompt_bytes: bytes,
        exclude: set[str],
        carrier: dict[str, str],
    ) -> AsyncIterator[worker_pb2.GenerateResponse]:
        """`cur`'s steps, its first one raced: when it is later than `cur`'s stall bound, the same attempt goes
        to a second worker too, and the first of the two to send a step wins; the other is cancelled (a late
        primary counts as stalled). `cur` is updated in place to the winner. With no worker to hedge to, `cur`
        is waited for. Raises TimeoutError when neither racer answers within its bound (a stall of `cur`)."""
        racers: dict[asyncio.Future[worker_pb2.GenerateResponse], _Attempt] = {_next(cur): cur}
        deadline: float | None = time.monotonic() + cur.watch.bound
        sent_hedge = False
        try:
            for _ in range(4):  # each pass ends the race, drops a racer or adds the one hedge
                left = None if deadline is None else max(deadline - time.monotonic(), 0.0)
                done, _ = await asyncio.wait(racers, timeout=left, return_when=asyncio.FIRST_COMPLETED)
                won = next((t for t in done if t.exception() is None), None)
                if won is not None:
                    self._hedge_won(cur, racers.pop(won), racers)
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
                    second = await self._hedge(rid, req, plan, so_far, prompt_bytes, exclude | {cur.wid}, carrier)
                    if second is not None:
                        racers[_next(second)] = second
                        deadline = time.monotonic() + self.stall.ttft_ceiling_s  # a busy pair is waited for
                    else:  # nowhere to hedge to: a late answer beats none (its call keeps its own deadline)
                        deadline = None
                    continue
                break
            else:
                raise AssertionError("unreachable: the race has at most 4 passes")
            if won is None:  # neither answered in time: the attempt stalls
                self._stall_race(cur, racers, exclude)
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

    async def _hedge(
        self,
        rid: str,
        req: RouterRequest,
        plan: at.NextAttempt,
        so_far: list[int],
        prompt_bytes: bytes,
        exclude: set[str],
        carrier: dict[str, str],
    ) -> _Attempt | None:
        """The hedge attempt on another worker, sent; None when no other worker can take it."""
        try:
            a = await self._dispatch(rid, req, plan, so_far, prompt_bytes, exclude)
        except KvmeshError:
            return None
        a.hedge = True
        try:
            await self._send(a, rid, carrier)
        except grpc.aio.AioRpcError as e:
            self._abandon(a, exclude, trip=f"hedge not sent: {e.code().name}")
            return None
        return a

    def _hedge_won(
        self, cur: _Attempt, winner: _Attempt, losers: dict[asyncio.Future[worker_pb2.GenerateResponse], _Attempt]
    ) -> None:
        """`winner` sent the first step: the losers are cancelled and `cur` becomes the winner."""
        if not winner.hedge and not losers:
            return  # no race was run: the primary answered in time
        m.HEDGES.labels("hedge" if winner.hedge else "primary").inc()
        for t, lost in list(losers.items()):
            t.cancel()
            self._abandon(lost, set(), stalled=not lost.hedge and lost.watch.silent(time.monotonic()))
        losers.clear()
        now = time.monotonic()
        self.tracker.assign(cur.request_id, winner.wid, winner.n_new, winner.kv_tokens, self.limits.block_size, now)
        if winner is not cur:
            cur.take(winner)

    def _stall_race(
        self, cur: _Attempt, racers: dict[asyncio.Future[worker_pb2.GenerateResponse], _Attempt], exclude: set[str]
    ) -> None:
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

    def _abandon(self, a: _Attempt, exclude: set[str], stalled: bool = False, trip: str = "") -> None:
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

    def _latency(self, wid: str) -> WorkerLatency:
        """The worker's recent latencies (its stall bounds), created on first use."""
        lat = self.latency.get(wid)
        if lat is None:
            lat = self.latency[wid] = WorkerLatency()
        return lat

    async def _dispatch(
        self,
        rid: str,
        req: RouterRequest,
        plan: at.NextAttempt,
        so_far: list[int],
        prompt_bytes: bytes,
        exclude: set[str],
    ) -> _Attempt:
        """Routes the next attempt (prompt + `so_far`), opens it on the chosen worker's breaker and in the
        in-flight tracker; returns it, not yet sent."""
        base = np.array(req.prompt.ids, dtype=np.uint32)
        prompt = np.concatenate([base, np.array(so_far, dtype=np.uint32)]) if so_far else base
        wid, overlap = await self.placement.route(
            rid, prompt, req.session_id, exclude, req.tenant, req.lora, plan.max_tokens
        )
        hint = self.placement.last_hint
        h = self.pool.by_id[wid]
        h.selections_total += 1
        now = time.monotonic()
        h.breaker.on_dispatch(now)
        n_new = len(prompt) - overlap
        self.tracker.assign(rid, wid, n_new, len(prompt), self.limits.block_size, now)
        head = worker_pb2.GenerateRequest(
            request_id=rid, tenant=req.tenant, lora_name=req.lora, detokenize=True, kv_pull=hint
        )
        request = attempt_request_bytes(head, req.sampling, plan, prompt_bytes, so_far)
        watch = StallWatch(
            self.stall,
            self._latency(wid),
            n_new,
            lambda: h.last_report_rx,
            lambda: self._routable_besides(exclude | {wid}),  # `exclude` as it is then
        )
        return _Attempt(rid, wid, h, request, n_new, len(prompt), watch)

    def _routable_besides(self, worker_ids: set[str]) -> bool:
        """Whether a worker outside `worker_ids` could take a request now."""
        return any(v.routable and v.id not in worker_ids for v in self.pool.views(time.monotonic()))

    def _record(self, wid: str, h: WorkerHandle, d: at.AttemptDecision, now: float) -> None:
        """Applies what the decision says the worker's breaker records."""
        if isinstance(d.breaker, at.BreakerSample):
            h.breaker.record(now, d.breaker.latency_ms, True)
        elif isinstance(d.breaker, at.BreakerTrip):
            self.pool.mark_failed(wid, now, d.breaker.reason)
