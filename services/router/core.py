"""The router's request path: admit → hash → route → stream, with retries and mid-stream migration.

For one request (token ids already known):

1. admission (`kvmesh.routing.Admission`): long prompts (> `long_prompt_tokens`) and short ones wait in
   separate bounded queues; a full queue raises RESOURCE_EXHAUSTED with a retry-after;
2. block hashes `compute_block_hashes(prompt, block_size, make_salt(salt_model, lora, tenant))` and
   per-worker overlap from the index replica; the routing profile picks a worker (the decision is timed,
   traced and logged at DEBUG);
3. the worker streams tokens; the in-flight tracker and the worker's breaker follow the request;
4. on a worker failure *before* the first token of an attempt the request is re-sent elsewhere (a retry,
   `kvmesh_retries_total`, at most `max_retries`); *after* tokens were streamed it resumes on another worker
   with prompt + tokens generated so far and the remaining `max_tokens` (a migration,
   `kvmesh_migrations_total`, at most `max_migrations`). The client sees one stream.
5. closing the stream (client cancel) cancels the worker call, which aborts the request on the worker.

Breaker samples: each finished attempt records its worst inter-token gap in ms (0 when only one message
arrived: time to first token grows with the prompt and the queue, so it is no sign of a sick worker) and
success; transport failures trip the breaker at once.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass, field

import grpc
import numpy as np

from kvmesh import hashing
from kvmesh.errors import InvalidArgument, ResourceExhausted, Unavailable
from kvmesh.protowire import length_delimited
from kvmesh.routing import Admission, InflightTracker, Profile, RouteRequest
from kvmesh.services.router import metrics as m
from kvmesh.services.router.index_replica import IndexReplica
from kvmesh.services.router.worker_stream import StreamedRequest
from kvmesh.services.router.workers import WorkerPool
from kvmesh.telemetry.tracing import inject, recording, tracer
from kvmesh.v1 import common_pb2, worker_pb2

log = logging.getLogger(__name__)

# Worker errors that say "this request is wrong", not "this worker is broken": passed to the client.
_CLIENT_ERRORS = {grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.OUT_OF_RANGE, grpc.StatusCode.FAILED_PRECONDITION}
_TOKEN_IDS_FIELD = worker_pb2.GenerateRequest.DESCRIPTOR.fields_by_name["token_ids"].number
_TRAILERS_GRACE_S = 5.0  # after a worker's final message, how long its call may take to end on its own


def _cancel_if_pending(call: grpc.aio.UnaryStreamCall | StreamedRequest) -> None:
    if not call.done():
        call.cancel()


def worker_request_bytes(head: worker_pb2.GenerateRequest, token_ids: bytes) -> bytes:
    """Wire bytes of `head` with `token_ids` (a serialised `TokenIds`) as its token_ids field: protobuf parses
    fields in any order, so the prompt is serialised once per request and never copied into a new message
    (an 8K-token CopyFrom costs ~90 µs). Concatenated `TokenIds` encodings merge (their ids concatenate)."""
    return head.SerializeToString() + length_delimited(_TOKEN_IDS_FIELD, token_ids)


@dataclass(slots=True)
class GenRequest:
    """A request after tokenisation. `resume_ids`: tokens the client already has from a broken stream."""

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


@dataclass
class CoreLimits:
    """Request guards and failure budgets."""

    block_size: int = 32
    max_prompt_tokens: int = 131072
    default_max_tokens: int = 256
    max_tokens_limit: int = 8192
    max_retries: int = 3
    max_migrations: int = 3
    queue_timeout_s: float = 30.0


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
    ) -> None:
        self.profile = profile
        self.pool = pool
        self.index = index
        self.tracker = tracker
        self.admission = admission
        self.limits = limits
        self.salt_model = salt_model
        self._salts: dict[tuple[str, str], int] = {}
        self.salt = self.salt_of("", "")
        self._waiters: dict[str, asyncio.Future[None]] = {}
        self._tracer = tracer("kvmesh.router")
        m.QUEUES.admission = admission

    def salt_of(self, lora: str, tenant: str) -> int:
        """Block-hash salt = `make_salt(salt_model, lora, tenant)`, as the cache-manager's `IndexHasher` salts a
        chain's first block (cached per (lora, tenant))."""
        key = (lora, tenant)
        salts = self._salts
        s = salts.get(key)
        if s is None:
            s = int(hashing.make_salt(self.salt_model, lora or None, tenant or None))
            if len(salts) < 65536:
                salts[key] = s
        return s

    # ---- admission ---------------------------------------------------------------------------------
    async def _admit(self, rid: str, n_prompt: int) -> None:
        now = time.monotonic()
        if self.admission.admit(rid, n_prompt, now):
            return
        fut: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self._waiters[rid] = fut
        try:
            await asyncio.wait_for(asyncio.shield(fut), self.limits.queue_timeout_s)
        except TimeoutError:
            self._waiters.pop(rid, None)
            self._release(rid)
            raise ResourceExhausted(
                "queued too long", retry_after_s=self.admission.retry_after(self.admission.class_of(n_prompt))
            ) from None
        except BaseException:
            self._waiters.pop(rid, None)
            self._release(rid)
            raise

    def _release(self, rid: str) -> None:
        for granted in self.admission.release(rid, time.monotonic()):
            f = self._waiters.pop(granted, None)
            if f is not None and not f.done():
                f.set_result(None)

    # ---- validation --------------------------------------------------------------------------------
    def check(self, req: GenRequest) -> int:
        """Validates sizes; returns the effective max_tokens."""
        lim = self.limits
        n = len(req.prompt.ids)
        if n == 0:
            raise InvalidArgument("prompt", "the prompt is empty")
        if n > lim.max_prompt_tokens:
            raise InvalidArgument("prompt", f"{n} tokens > limit {lim.max_prompt_tokens}")
        mt = req.sampling.max_tokens or lim.default_max_tokens
        if mt > lim.max_tokens_limit:
            raise InvalidArgument("max_tokens", f"{mt} > limit {lim.max_tokens_limit}")
        return mt

    # ---- routing -----------------------------------------------------------------------------------
    async def route(
        self,
        rid: str,
        prompt: np.ndarray,
        session: str,
        exclude: set[str],
        tenant: str = "",
        lora: str = "",
        max_tokens: int = 256,
    ) -> tuple[str, int]:
        """Picks a worker for `prompt` (uint32 token ids); returns (worker id, cached overlap tokens on it).
        Hashes are salted with `make_salt(salt_model, lora, tenant)`: one tenant never matches another's blocks."""
        hashes = hashing.compute_block_hashes(prompt, self.limits.block_size, self.salt_of(lora, tenant))
        matches = await self.index.matches(hashes, tenant=tenant, lora=lora)
        t0 = time.perf_counter()
        now = time.monotonic()
        views = self.pool.views(now)
        if exclude:
            views = [v for v in views if v.id not in exclude]
        self.tracker.apply(views)
        rr = RouteRequest(
            rid, len(prompt), hashes, matches, self.limits.block_size, session_id=session, max_tokens=max_tokens
        )
        d = self.profile.decide(rr, views)
        m.DECISION.observe(time.perf_counter() - t0)
        if recording():
            with self._tracer.start_as_current_span("route") as span:
                span.set_attribute("kvmesh.request_id", rid)
                span.set_attribute("kvmesh.worker", d.worker_id or "")
                span.set_attribute("kvmesh.decision", json.dumps(d.to_log()))
        if d.worker_id is None:
            if d.rejected_by == "kv-headroom":
                raise ResourceExhausted("every worker's KV cache is full", retry_after_s=1.0)
            raise Unavailable(f"no worker available (rejected by {d.rejected_by})")
        overlap = rr.overlap_tokens(d.worker_id)
        m.SELECTIONS.labels(d.worker_id).inc()
        m.ROUTED_PROMPT_TOKENS.inc(len(prompt))
        m.ROUTED_CACHED_TOKENS.inc(overlap)
        return d.worker_id, overlap

    # ---- the stream --------------------------------------------------------------------------------
    async def generate(self, req: GenRequest) -> AsyncIterator[Chunk]:
        """Streams the request's tokens, retrying and migrating across workers as needed."""
        max_tokens = self.check(req)
        rid = req.request_id or uuid.uuid4().hex
        started = time.monotonic()
        await self._admit(rid, len(req.prompt.ids))
        try:
            async for c in self._run(rid, req, max_tokens, started):
                yield c
        finally:
            self._release(rid)

    async def _run(self, rid: str, req: GenRequest, max_tokens: int, started: float) -> AsyncIterator[Chunk]:
        generated: list[int] = list(req.resume_ids)
        n_prompt = len(req.prompt.ids)
        base = np.array(req.prompt.ids, dtype=np.uint32)
        prompt_bytes = req.prompt.SerializeToString() if req.prompt_bytes is None else req.prompt_bytes
        retries = migrations = 0
        exclude: set[str] = set()
        first_client_token = False
        last_emit = started
        while True:
            remaining = max_tokens - len(generated)
            if remaining <= 0:
                usage = common_pb2.Usage(prompt_tokens=n_prompt, completion_tokens=len(generated))
                yield Chunk([], "", "", migrations, common_pb2.FINISH_REASON_LENGTH, usage)
                return
            prompt = np.concatenate([base, np.array(generated, dtype=np.uint32)]) if generated else base
            wid, overlap = await self.route(
                rid, prompt, req.session_id, exclude, req.tenant, req.lora, max_tokens=remaining
            )
            h = self.pool.by_id[wid]
            h.selections_total += 1
            now = time.monotonic()
            h.breaker.on_dispatch(now)
            self.tracker.assign(rid, wid, len(prompt) - overlap, len(prompt), self.limits.block_size, now)
            sp = common_pb2.SamplingParams()
            sp.CopyFrom(req.sampling)
            sp.max_tokens = remaining
            sp.min_tokens = max(sp.min_tokens - len(generated), 0)
            head = worker_pb2.GenerateRequest(
                request_id=rid, sampling=sp, tenant=req.tenant, lora_name=req.lora, detokenize=True
            )
            ids = prompt_bytes + common_pb2.TokenIds(ids=generated).SerializeToString() if generated else prompt_bytes
            carrier: dict[str, str] = {}
            inject(carrier)
            call: grpc.aio.UnaryStreamCall | StreamedRequest | None = None
            n_tok = 0
            t_attempt = time.monotonic()
            t_prev = t_attempt
            max_gap_ms = 0.0
            finished = False
            try:
                call = await h.generate(rid, worker_request_bytes(head, ids), carrier)
                async for resp in call:
                    t = time.monotonic()
                    if resp.token_ids:
                        if n_tok == 0:
                            self.tracker.first_token(rid)
                        else:
                            max_gap_ms = max(max_gap_ms, (t - t_prev) * 1000)
                        n_tok += 1
                        t_prev = t
                    if resp.token_ids:
                        generated.extend(resp.token_ids)
                        if not first_client_token:
                            first_client_token = True
                            m.TTFT.observe(t - started)
                        else:
                            m.ITL.observe(t - last_emit)
                        last_emit = t
                    if resp.finish_reason:
                        u = resp.usage
                        usage = common_pb2.Usage(
                            prompt_tokens=n_prompt,
                            cached_tokens=min(u.cached_tokens, n_prompt),
                            completion_tokens=len(generated),
                        )
                        h.breaker.record(t, max_gap_ms, True)
                        m.E2E.observe(t - started)
                        finished = True
                        yield Chunk(list(resp.token_ids), resp.text, wid, migrations, resp.finish_reason, usage)
                        return
                    if resp.token_ids or resp.text:
                        yield Chunk(list(resp.token_ids), resp.text, wid, migrations)
                # the stream ended without a finish reason: the worker went away
                err: str = "stream ended without finish"
            except grpc.aio.AioRpcError as e:
                if e.code() in _CLIENT_ERRORS:
                    raise InvalidArgument("request", f"worker rejected the request: {e.details()}") from None
                if e.code() == grpc.StatusCode.CANCELLED and call is not None and call.cancelled():
                    raise
                err = f"{e.code().name}: {e.details()}"
                if e.code() != grpc.StatusCode.RESOURCE_EXHAUSTED:
                    self.pool.mark_failed(wid, time.monotonic(), err)
                else:
                    h.breaker.record(time.monotonic(), 0.0, True)
            finally:
                if call is not None and not call.done():
                    if finished:  # its trailers are on their way: no abort, and none on the client's critical path
                        asyncio.get_running_loop().call_later(_TRAILERS_GRACE_S, _cancel_if_pending, call)
                    else:
                        call.cancel()
                self.tracker.finish(rid)
            exclude.add(wid)
            if n_tok == 0:
                retries += 1
                m.RETRIES.inc()
                log.warning(
                    "request %s: worker %s failed before its first token (%s); retry %d", rid, wid, err, retries
                )
                if retries > self.limits.max_retries:
                    raise Unavailable(f"request {rid} failed on {retries} workers: {err}")
            else:
                migrations += 1
                m.MIGRATIONS.inc()
                log.warning(
                    "request %s: worker %s failed after %d tokens (%s); migration %d",
                    rid,
                    wid,
                    len(generated),
                    err,
                    migrations,
                )
                if migrations > self.limits.max_migrations:
                    raise Unavailable(f"request {rid} migrated {migrations} times: {err}")
