"""Live replay: a trace sent to a running kvmesh router over gRPC, measured from the client side.

Time scale. The suite's simulated workers run ``S`` times faster than real time (``--sim-speed S``), so the
replay compresses the trace by the same factor and converts every measured wall time back:

* request ``i`` is sent at wall time ``t0 + a_i / (load_scale · S)`` (``a_i`` its trace arrival; the
  simulator's arrival is ``a_i / load_scale``); a follow-up (``follows``) is sent ``think_s / S`` after the
  request it follows completes;
* simulated time of a wall instant ``w`` = ``(w − t0) · S``; a request's arrival is its *scheduled* send time
  (so a late client counts against TTFT instead of hiding it), first token = first message carrying tokens,
  finish = the message with a finish reason.

Each request carries the prompt :func:`kvmesh.fleet.trace.prompt_tokens` expands from its chunk ids (the
tokens the simulator's engines see), ``max_tokens`` = its output length and ``ignore_eos``. All requests run
concurrently as they arrive; the replay is bounded by ``max_requests`` and by a wall deadline (requests still
running then are cancelled and count as unfinished). The records are :class:`~kvmesh.fleet.metrics.
RequestRecord` in simulated seconds, so :func:`live_summary` is the simulator's :func:`~kvmesh.fleet.metrics.
summarize` minus what a client cannot see (worker busy time, utilisation, cost), plus errors and the
client's own lateness.
"""

from __future__ import annotations

import asyncio
import math
import time
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import grpc

from kvmesh.engine.sim.perf import chunked_prefill_time
from kvmesh.fleet.metrics import RequestRecord, Slo, summarize
from kvmesh.fleet.trace import DEFAULT_VOCAB, Trace, prompt_tokens
from kvmesh.v1 import common_pb2, router_pb2, router_pb2_grpc

_OPTS = [("grpc.max_send_message_length", 64 << 20), ("grpc.max_receive_message_length", 64 << 20)]
_BUILD_AHEAD_S = 0.25
_SERVER_ONLY = ("util_mean", "util_variance", "util_cv", "busy_mean", "cost_per_mtok")


@dataclass(frozen=True, slots=True)
class LiveConfig:
    """How to replay: ``speed`` = the workers' ``--sim-speed``; bounds in requests and wall seconds."""

    speed: float = 1.0
    load_scale: float = 1.0
    max_requests: int | None = None
    max_wall_s: float = 120.0
    vocab_size: int = DEFAULT_VOCAB
    prefill_chunk_tokens: int = 1024  # only for the TTFT allowance of Slo(ttft_mode="excess")
    slo: Slo = Slo()
    model: str = ""
    api_key: str = ""
    channels: int = 4  # client channels, requests spread round-robin (one HTTP/2 connection each)


@dataclass(slots=True)
class LiveResult:
    """Per-request records (simulated seconds), errors by kind, and how the client kept time."""

    records: list[RequestRecord]
    errors: Counter[str] = field(default_factory=Counter)
    truncated: bool = False
    wall_s: float = 0.0
    send_lag_s: list[float] = field(default_factory=list)  # wall lateness of each send vs its schedule
    summary: dict[str, Any] = field(default_factory=dict)


def live_summary(res: LiveResult, cfg: LiveConfig) -> dict[str, Any]:
    """``summarize`` of the records without the server-side keys, plus ``errors``, ``send_lag_ms_max``,
    ``workers_used`` (requests per worker id), ``wall_s``, ``speed`` and ``truncated``."""
    s: dict[str, Any] = dict(summarize(res.records, {}, cfg.slo))
    for k in _SERVER_ONLY:
        s.pop(k, None)
    lag = max(res.send_lag_s, default=0.0)
    s.update(
        errors=sum(res.errors.values()),
        error_kinds=dict(res.errors),
        send_lag_ms_max=1000 * lag,
        workers_used=dict(Counter(r.worker for r in res.records if r.worker)),
        wall_s=res.wall_s,
        speed=cfg.speed,
        truncated=res.truncated,
    )
    return s


class _Replay:
    def __init__(self, trace: Trace, address: str, cfg: LiveConfig) -> None:
        n = len(trace) if cfg.max_requests is None else min(cfg.max_requests, len(trace))
        self.trace = trace.head(n) if n < len(trace) else trace
        self.cfg = cfg
        self.address = address
        self.records: dict[int, RequestRecord] = {}
        self.errors: Counter[str] = Counter()
        self.lag: list[float] = []
        self.children: dict[int, list[int]] = {}
        for r in self.trace.requests:
            if r.follows is not None:
                self.children.setdefault(r.follows, []).append(r.index)
        self.tasks: set[asyncio.Task[None]] = set()
        self.stubs: list[router_pb2_grpc.RouterServiceStub] = []
        self.t0 = 0.0

    def sim_time(self, wall: float) -> float:
        return (wall - self.t0) * self.cfg.speed

    def _launch(self, i: int, at_wall: float) -> None:
        task = asyncio.get_running_loop().create_task(self._one(i, at_wall))
        self.tasks.add(task)
        task.add_done_callback(self.tasks.discard)

    async def _one(self, i: int, at_wall: float) -> None:
        cfg = self.cfg
        ahead = at_wall - _BUILD_AHEAD_S - time.monotonic()
        if ahead > 0:  # build the request shortly before it is due (not all at once, not late)
            await asyncio.sleep(ahead)
        r = self.trace.requests[i]
        req = router_pb2.RouterServiceGenerateRequest(
            request_id=f"live-{i}",
            token_ids=common_pb2.TokenIds(ids=prompt_tokens(r, cfg.vocab_size).tolist()),
            sampling=common_pb2.SamplingParams(max_tokens=r.output_len, ignore_eos=True, seed=i),
            model=cfg.model,
            session_id=r.session or "",
            tenant=r.tenant or "",
        )
        md = (("authorization", f"Bearer {cfg.api_key}"),) if cfg.api_key else ()
        delay = at_wall - time.monotonic()
        if delay > 0:
            await asyncio.sleep(delay)
        rec = RequestRecord(i, "", self.sim_time(at_wall), r.input_len, r.output_len)
        if cfg.slo.ttft_mode == "excess":
            rec.ttft_allow = chunked_prefill_time(r.input_len, 0, cfg.prefill_chunk_tokens)
        self.records[i] = rec
        stub = self.stubs[i % len(self.stubs)]
        self.lag.append(max(0.0, time.monotonic() - at_wall))
        got = 0
        call = stub.Generate(req, metadata=md)
        try:
            async for m in call:
                now = time.monotonic()
                if m.token_ids and math.isnan(rec.first_token):
                    rec.first_token = self.sim_time(now)
                got += len(m.token_ids)
                if m.worker_id:
                    rec.worker = m.worker_id
                if m.finish_reason:
                    rec.finish = self.sim_time(now)
                    rec.cached_tokens = m.usage.cached_tokens
                    if got != r.output_len:
                        self.errors["short_output"] += 1
            if math.isnan(rec.finish):
                self.errors["no_finish"] += 1
        except grpc.aio.AioRpcError as e:
            self.errors[e.code().name] += 1
            return
        finally:
            if not call.done():
                call.cancel()
        if not math.isnan(rec.finish):
            done = time.monotonic()
            for c in self.children.get(i, ()):
                self._launch(c, done + self.trace.requests[c].think_s / cfg.speed)

    async def run(self) -> LiveResult:
        cfg = self.cfg
        chans = [grpc.aio.insecure_channel(self.address, options=_OPTS) for _ in range(max(1, cfg.channels))]
        self.stubs = [router_pb2_grpc.RouterServiceStub(c) for c in chans]
        try:
            for c in chans:
                await asyncio.wait_for(c.channel_ready(), timeout=min(30.0, cfg.max_wall_s))
            self.t0 = time.monotonic() + 0.05
            rate = cfg.load_scale * cfg.speed
            for r in self.trace.requests:
                if r.follows is None:
                    self._launch(r.index, self.t0 + r.arrival_s / rate)
            deadline = self.t0 + cfg.max_wall_s
            truncated = False
            while self.tasks:  # bounded: each pass waits for ≥ 1 task or hits the deadline
                left = deadline - time.monotonic()
                if left <= 0:
                    truncated = True
                    for t in list(self.tasks):
                        t.cancel()
                    await asyncio.gather(*self.tasks, return_exceptions=True)
                    break
                await asyncio.wait(set(self.tasks), timeout=left, return_when=asyncio.FIRST_COMPLETED)
            wall = time.monotonic() - self.t0
        finally:
            for c in chans:
                await c.close()
        recs = [self.records[i] for i in sorted(self.records)]
        res = LiveResult(recs, self.errors, truncated, wall, self.lag)
        res.summary = live_summary(res, cfg)
        return res


async def replay(trace: Trace, address: str, cfg: LiveConfig = LiveConfig()) -> LiveResult:
    """Replays ``trace`` (its first ``cfg.max_requests``) against the router at ``address``; see module doc."""
    return await _Replay(trace, address, cfg).run()


def agreement(
    live: dict[str, Any], sim: dict[str, Any], keys: Sequence[str] = ("ttft_ms", "itl_ms", "e2e_ms")
) -> dict[str, Any]:
    """Live vs simulator: live/sim ratio of each percentile in ``keys`` (p50, p90, p99), the hit-ratio
    difference live − sim, both completed counts and both placements (requests per worker, sorted
    descending: worker ids differ between the two)."""
    out: dict[str, Any] = {
        "requests": {"live": live.get("requests", 0), "sim": sim.get("requests", 0)},
        "placement": {
            k: sorted(s.get("workers_used", {}).values(), reverse=True) for k, s in (("live", live), ("sim", sim))
        },
        "hit_ratio_diff": float(live.get("hit_ratio", math.nan)) - float(sim.get("hit_ratio", math.nan)),
    }
    for k in keys:
        lv, sv = live.get(k, {}), sim.get(k, {})
        out[f"{k}_ratio"] = {
            p: (lv[p] / sv[p] if sv.get(p) else math.nan) for p in ("p50", "p90", "p99") if p in lv and p in sv
        }
    return out
