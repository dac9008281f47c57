"""The router's request path: admit → hash → route → stream, with retries and mid-stream migration.

For one request (checked at its door: `request.RouterRequest`):

1. admission (`AdmissionGate` over `kvmesh.routing.Admission`): long prompts (> `long_prompt_tokens`) and
   short ones wait in separate bounded queues; a full queue raises RESOURCE_EXHAUSTED with a retry-after;
2. `Placement` hashes the prompt (salted per model, LoRA and tenant) and the routing profile picks a worker
   with the index replica's per-worker overlap;
3. the worker streams tokens; the in-flight tracker and the worker's breaker follow the request; a stream
   that sends nothing for longer than the worker's stall bound (`stall_watch`, `kvmesh.routing.stall`: its
   time to first token, then between tokens) is cancelled and ends `Stalled` (a frozen worker keeps its
   connection open); with `StallConfig.hedge`, a request's first attempt races a second worker for its
   first token (`hedging`);
4. when an attempt ends, `kvmesh.routing.attempts` decides: done, a retry elsewhere (no token yet,
   `kvmesh_retries_total`, at most `max_retries`), a migration (prompt + tokens so far and the remaining
   `max_tokens` on another worker, `kvmesh_migrations_total`, at most `max_migrations`) or fail, and what
   the breaker records. The client sees one stream.
   With `n > 1` the attempt runs every sequence on one worker (`sequences`: each one's tokens apart, the
   request done when all have finished); a migration resumes each unfinished sequence on its own.
5. closing the stream (client cancel) cancels the worker call, which aborts the request on the worker.
"""

from __future__ import annotations

import asyncio
import functools
import time
from collections import defaultdict
from collections.abc import AsyncIterator

import grpc

from kvmesh.core.errors import Unavailable
from kvmesh.routing import Admission, InflightTracker, Profile
from kvmesh.routing import attempts as at
from kvmesh.routing.dataplane import DEFAULT_PULL_MARGIN
from kvmesh.routing.disagg import PdParams
from kvmesh.routing.stall import StallConfig, WorkerLatency
from kvmesh.rpc.errors import invalid_field
from kvmesh.services.router import metrics as m
from kvmesh.services.router.admission_wait import AdmissionGate
from kvmesh.services.router.attempt import Attempt, worker_request
from kvmesh.services.router.chunks import Chunk, chunk_of
from kvmesh.services.router.disaggregation import Disaggregation, HandedOver, PdSettings, pd_eligible
from kvmesh.services.router.hedging import Hedging
from kvmesh.services.router.index_replica import IndexReplica
from kvmesh.services.router.limits import CoreLimits
from kvmesh.services.router.observe import StreamClock, record_attempt_end
from kvmesh.services.router.placement import Placement
from kvmesh.services.router.request import RouterRequest
from kvmesh.services.router.sequences import Sequences, resume_sequences
from kvmesh.services.router.stall_watch import StallWatch
from kvmesh.services.router.worker_stream import classify, close_call
from kvmesh.services.router.workers import WorkerHandle, WorkerPool
from kvmesh.telemetry.tracing import inject
from kvmesh.v1 import common_pb2


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
        pd: PdSettings | None = None,
        pd_params: PdParams | None = None,
    ) -> None:
        self.profile, self.pool, self.index, self.tracker = profile, pool, index, tracker
        self.stall = stall or StallConfig()
        # per worker id, created on first use: what its stall bounds derive from
        self.latency: defaultdict[str, WorkerLatency] = defaultdict(WorkerLatency)
        self.admission, self.limits, self.salt_model = admission, limits, salt_model
        self.gate = AdmissionGate(admission, limits.queue_timeout_s)
        self.placement = Placement(profile, pool, index, tracker, limits.block_size, salt_model, pull_margin)
        self.hedging = Hedging(pool, tracker, limits.block_size, self.stall.ttft_ceiling_s)
        self.pd = Disaggregation(pd or PdSettings(), pool, tracker)
        if self.pd.settings.enabled:
            self.placement.pd_params = pd_params or PdParams()
        m.QUEUES.admission = admission

    async def generate(self, req: RouterRequest) -> AsyncIterator[Chunk]:
        """Streams the request's tokens, retrying and migrating across workers as needed."""
        started = time.monotonic()
        await self.gate.admit(req.request_id, len(req.prompt), req.sampling.priority)
        try:
            async for c in self._run(req, started):
                yield c
        finally:
            self.gate.release(req.request_id)

    async def _run(self, req: RouterRequest, started: float, migrations: int = 0) -> AsyncIterator[Chunk]:
        """The attempts loop; `migrations`: already used (a resumed sequence's, `sequences`)."""
        lim, rid = self.limits, req.request_id
        limits = at.Limits(lim.max_retries, lim.max_migrations, req.max_tokens)
        att = at.Attempts(rid, limits, req.resume_ids)
        att.migrations = migrations
        seqs = Sequences(req.sampling.n)
        n_prompt = len(req.prompt)
        exclude: set[str] = set()
        clock = StreamClock(started)
        hedged = False  # only a request's first attempt may race a hedge
        while True:
            plan = att.next_attempt(req.sampling.min_tokens)
            if isinstance(plan, at.LengthReached):
                usage = common_pb2.Usage(prompt_tokens=n_prompt, completion_tokens=att.n_generated)
                yield Chunk([], "", "", att.migrations, common_pb2.FINISH_REASON_LENGTH, usage)
                return
            first = not hedged and not exclude and migrations == 0 and att.migrations == 0
            cur = await self._dispatch(rid, req, plan, att.tokens, exclude, pd=first)
            carrier: dict[str, str] = {}
            inject(carrier)
            clock.new_attempt(time.monotonic())
            outcome: at.Outcome = at.Ended()
            own_error: grpc.aio.AioRpcError | None = None
            hedge = self.stall.hedge and self.stall.enabled and not hedged
            try:
                if not hedge:  # a hedged first token has its own race (`Hedging.steps`)
                    cur.watch.arm()
                await cur.send(carrier)
                if hedge:
                    hedged = True
                    again = functools.partial(self._dispatch, rid, req, plan, att.tokens)  # the hedge's routing
                    steps = self.hedging.steps(cur, exclude, again, carrier)
                else:
                    steps = cur.it
                async for resp in steps:
                    t = time.monotonic()
                    cur.watch.on_step(t, bool(resp.token_ids))
                    if resp.token_ids:
                        if clock.on_tokens(t):
                            self.tracker.first_token(rid)
                        att.add(resp.token_ids)
                        seqs.add(resp.index, resp.token_ids)
                    if resp.finish_reason and seqs.finish(resp.index):  # the request's last sequence
                        outcome = at.Finished(resp.finish_reason, clock.max_gap_ms)
                        self._record(cur.wid, cur.h, att.end(outcome), t)
                        clock.on_finish(t)
                        cached = min(resp.usage.cached_tokens if cur.cached is None else cur.cached, n_prompt)
                        usage = common_pb2.Usage(
                            prompt_tokens=n_prompt, cached_tokens=cached, completion_tokens=att.n_generated
                        )
                        cur.watch.disarm()
                        yield chunk_of(resp, cur.wid, att.migrations, resp.finish_reason, usage)
                        return
                    if resp.token_ids or resp.text or resp.finish_reason or resp.prompt_logprobs:
                        cur.watch.pause()  # the client's pace is no worker's stall
                        yield chunk_of(resp, cur.wid, att.migrations, resp.finish_reason)
                    cur.watch.arm()
            except asyncio.CancelledError:
                if not cur.watch.stalled():
                    raise
                outcome = at.Stalled(cur.watch.detail(cur.wid))
            except TimeoutError:  # a hedged race that neither racer answered
                outcome = at.Stalled(cur.watch.detail(cur.wid))
            except grpc.aio.AioRpcError as e:
                failure, detail = classify(e, cur.call), f"{e.code().name}: {e.details()}"
                outcome, own_error = at.Failed(failure, detail, invalid_field(e)), e
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
            if d.action is at.Action.MIGRATE and seqs.n > 1:
                resumed = resume_sequences(self._run, started, req, seqs, att.n_generated, att.migrations)
                async for c in resumed:
                    yield c
                return

    async def _dispatch(
        self,
        rid: str,
        req: RouterRequest,
        plan: at.NextAttempt,
        so_far: list[int],
        exclude: set[str],
        pd: bool = False,
    ) -> Attempt:
        """Routes the next attempt (prompt + `so_far`), opens it on the chosen worker's breaker and in the
        in-flight tracker; returns it, not yet sent. With `pd` (a request's first attempt) the decision may
        disaggregate it: the prefill half runs here (`disaggregation`), and the attempt is the decode half."""
        prompt = req.prompt.array_with(so_far)
        pd = pd and pd_eligible(req, so_far)
        route = functools.partial(
            self.placement.route,
            rid,
            prompt,
            req.session_id,
            tenant=req.tenant,
            lora=req.lora,
            max_tokens=plan.max_tokens,
        )
        routed = await route(exclude, max_tokens=plan.max_tokens, pd=pd)
        handed: HandedOver | None = None
        if routed.prefill is not None:
            handed = await self.pd.prefill(rid, req, routed.prefill, self.limits.block_size)
            if handed.fallback in ("prefill_failed", "prefill_timeout"):  # routed again, aggregated
                routed = await route(exclude | {routed.prefill.worker_id}, max_tokens=plan.max_tokens)
        wid, overlap = routed.worker_id, routed.overlap
        h = self.pool.by_id[wid]
        h.selections_total += 1
        now = time.monotonic()
        h.breaker.on_dispatch(now)
        n_new = len(prompt) - overlap
        self.tracker.assign(rid, wid, n_new, len(prompt), self.limits.block_size, now)
        handoff = handed.handoff if handed is not None else None
        request = worker_request(rid, req, plan, so_far, routed.pull, handoff, h.view.engine_handoff)
        # a decode half's first token may come after the whole prompt's prefill there (a handoff that fails is
        # computed): its stall bound is the full prompt's, never the handoff's few tokens
        watched_new = len(prompt) if routed.prefill is not None else n_new
        watch = StallWatch(
            self.stall,
            self.latency[wid],
            watched_new,
            lambda: h.last_report_rx,
            lambda: self._routable_besides(exclude | {wid}),  # `exclude` as it is then
        )
        cur = Attempt(rid, wid, h, request, n_new, len(prompt), watch, req.sampling.n)
        if handoff is not None:
            cur.cached = handoff.cached_tokens  # the client's cached tokens: the prefill worker's hit
        return cur

    def _routable_besides(self, worker_ids: set[str]) -> bool:
        """Whether a worker outside `worker_ids` could take a request now (a prefill worker takes none)."""
        return any(v.routable and v.role.decodes and v.id not in worker_ids for v in self.pool.views(time.monotonic()))

    def _record(self, wid: str, h: WorkerHandle, d: at.AttemptDecision, now: float) -> None:
        """Applies what the decision says the worker's breaker records."""
        if isinstance(d.breaker, at.BreakerSample):
            h.breaker.record(now, d.breaker.latency_ms, True)
        elif isinstance(d.breaker, at.BreakerTrip):
            self.pool.mark_failed(wid, now, d.breaker.reason)
