"""The router's worker pool: one gRPC channel per worker, its info, its load-report stream and breaker.

Each worker is followed by one supervised task: `GetInfo` (identity, zone, version, KV capacity, its tier
service and KV transfer costs: `WorkerView.transfer`, None when it has no KV data plane), then
`StreamLoad` at `load_interval_ms`; every report refreshes the worker's `WorkerView` and tells the in-flight
tracker which assignments the report already includes. A broken stream marks the worker unhealthy and trips
its breaker at once (a killed worker leaves rotation as soon as its connection breaks: well under a second
on loopback); a worker that stays connected but sends no report for `stale_after_s` is unhealthy too (a
frozen worker keeps its connection open: only the silence tells), whatever its health endpoint says. That
bound is `kvmesh.routing.stall.report_age_bound`: `report_age_intervals` (5) report intervals, at least
`report_age_floor_s` (5 s: a vLLM worker streaming a long output on a loaded 2-core host lagged its reports by
over 2 s, and every request then got 503) and at most `max_report_age_s` (10 s), so 5 s at the default 200 ms
interval. A frozen worker leaves rotation sooner through its breaker (a stalled stream trips it).
The task reconnects with bounded exponential back-off until the pool stops. A worker whose `GetInfo` block
size differs from the router's (`block_size`), or that does not offer `GenerateStream` (a version older than
the stream transport), is logged as an error saying why and never routed to (no id, no load stream) until it
agrees.

Requests go to a worker on its `GenerateStream` (`transport="stream"`, the default: a gRPC call a service
mesh sees), or, opted into with `transport="frames"`, on generate frames where its `GetInfo` offers them and
its frames port answers, else on the stream.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from dataclasses import dataclass, field

import grpc

from kvmesh.core.config import ServerSettings
from kvmesh.routing import BreakerConfig, CircuitBreaker, InflightTracker, WorkerView
from kvmesh.routing.stall import report_age_bound
from kvmesh.routing.types import TransferCosts
from kvmesh.rpc.agreement import Agreed, disagreements
from kvmesh.rpc.channel import CHANNEL_OPTIONS, open_channel
from kvmesh.services.router import metrics as m
from kvmesh.services.router.stream_requests import StreamedRequest
from kvmesh.services.router.worker_frames import ConnectFailed, FramedWorkerStream
from kvmesh.services.router.worker_stream import WorkerStream
from kvmesh.v1 import common_pb2, worker_pb2, worker_pb2_grpc
from kvmesh.wire.proto import load_from_proto, role_from_proto

log = logging.getLogger(__name__)


_FAST_OPTIONS = [
    *CHANNEL_OPTIONS,
    ("grpc.http2.lookahead_bytes", 8 * 1024 * 1024),  # large initial stream window: 100K-token prompts
]


def _worker_channel(address: str, settings: ServerSettings) -> grpc.aio.Channel:
    """The channel to a worker, TLS as configured. Plaintext, it is the hot path, so without client interceptors
    (each streamed message through a Python interceptor costs tens of µs; the caller injects trace context);
    with TLS the propagating interceptor stays, as it always had."""
    if settings.tls_ca:
        return open_channel(address, settings)
    return open_channel(address, settings, options=_FAST_OPTIONS, propagate=False)  # its token, if any


@dataclass
class WorkerHandle:
    """One worker as the router holds it. `view.id` is the worker id from GetInfo ('' until known)."""

    address: str
    channel: grpc.aio.Channel
    stub: worker_pb2_grpc.WorkerServiceStub
    stream: WorkerStream  # GenerateStream transport (always: the fallback of frames)
    breaker: CircuitBreaker
    view: WorkerView
    model: str = ""
    max_model_len: int = 0  # its engine's context, tokens (GetInfo; 0 until known)
    last_report_rx: float = float("-inf")
    selections_total: int = 0
    last_report: common_pb2.LoadReport = field(default_factory=common_pb2.LoadReport)
    frames: FramedWorkerStream | None = None  # generate frames (transport "frames", where the worker offers it)
    frames_off_until: float = float("-inf")  # monotonic: its listener did not answer, use the gRPC stream
    disagreement: str = ""  # why the worker is not routed to: its settings disagree with the router's

    async def generate(
        self, request_id: str, request_bytes: bytes, carrier: dict[str, str], sequences: int = 1
    ) -> StreamedRequest:
        """Sends a serialised GenerateRequest; returns a call-like handle of its response steps. On generate
        frames where the router opted in and the worker offers them; a worker whose frames port does not
        answer gets its requests on the gRPC stream for `FRAMES_RETRY_S` (a firewall that lets gRPC through
        and not the frames port); otherwise on the gRPC stream. `sequences`: the request's n (its handle ends
        once each has a finish reason)."""
        traceparent = carrier.get("traceparent", "")
        if self.frames is not None and self.frames_off_until < time.monotonic():
            try:
                return await self.frames.start(request_id, request_bytes, traceparent, sequences)
            except ConnectFailed as exc:
                self.frames_off_until = time.monotonic() + FRAMES_RETRY_S
                m.WORKER_FRAMES_UNREACHABLE.inc()
                log.warning("worker %s: %s; using its gRPC stream for %.0f s", self.address, exc, FRAMES_RETRY_S)
        return await self.stream.start(request_id, request_bytes, traceparent, sequences)


def transfer_from_proto(t: worker_pb2.KvTransferCosts) -> TransferCosts:
    """The worker's GetInfo transfer costs as the routing cost prices them."""
    return TransferCosts(t.prefill_s_per_token, t.block_load_s, t.block_pull_s, t.pull_rtt_s)


FRAMES_RETRY_S = 30.0
STARTUP_SETTLE_S = 5.0  # a request this soon after the pool starts waits for every worker's first report
TRANSPORTS = ("stream", "frames")  # the default first: every request on a gRPC call a service mesh sees


class _Disagrees(Exception):
    """The worker's settings disagree with the router's (see `WorkerPool._agrees`)."""


class WorkerPool:
    """All workers of this router; `routable_views(now)` is what the routing profile sees."""

    def __init__(
        self,
        addresses: list[str],
        settings: ServerSettings,
        tracker: InflightTracker,
        breaker: BreakerConfig | None = None,
        load_interval_ms: int = 200,
        max_report_age_s: float = 10.0,
        transport: str = "stream",
        block_size: int = 0,
        report_age_intervals: float = 5.0,
        report_age_floor_s: float = 5.0,
    ) -> None:
        if transport not in TRANSPORTS:
            raise ValueError(f"worker transport must be one of {', '.join(TRANSPORTS)}, got {transport!r}")
        self.transport = transport
        self.tracker = tracker
        self.load_interval_ms = load_interval_ms
        self.stale_after_s = report_age_bound(
            load_interval_ms / 1000, report_age_intervals, report_age_floor_s, max_report_age_s
        )
        self.block_size = block_size  # the router's; a worker reporting another one is not routed to (0 = any)
        self._breaker_cfg = breaker or BreakerConfig()
        self._settings = settings
        self.handles: list[WorkerHandle] = []
        self.by_id: dict[str, WorkerHandle] = {}
        self.ready = asyncio.Event()
        self._settled_by = float("-inf")  # until `start`: a request before it waits for no one
        self._tasks: dict[str, asyncio.Task[None]] = {}
        self._started = False
        self._closing: set[asyncio.Future[None]] = set()
        self._stopping = asyncio.Event()
        for a in addresses:
            self.add(a)

    def add(self, address: str) -> WorkerHandle:
        """Adds a worker by gRPC address (followed at once if the pool runs); an address already held is kept."""
        for old in self.handles:
            if old.address == address:
                return old
        ch = _worker_channel(address, self._settings)
        h = WorkerHandle(
            address=address,
            channel=ch,
            stub=worker_pb2_grpc.WorkerServiceStub(ch),
            stream=WorkerStream(ch, address),
            breaker=CircuitBreaker(self._breaker_cfg),
            view=WorkerView(id="", healthy=False),
        )
        self.handles.append(h)
        if self._started:
            self._tasks[address] = asyncio.create_task(self._follow(h))
        return h

    def remove(self, address: str, grace_s: float = 30.0) -> WorkerHandle | None:
        """Takes the worker at `address` out of the pool at once (no new request is routed to it); requests
        already streaming from it keep their channel for up to `grace_s` before it closes."""
        h = next((x for x in self.handles if x.address == address), None)
        if h is None:
            return None
        self.handles.remove(h)
        if h.view.id and self.by_id.get(h.view.id) is h:
            del self.by_id[h.view.id]
            self.tracker.forget_worker(h.view.id)
        h.view.healthy = False
        task = self._tasks.pop(address, None)
        if task is not None:
            task.cancel()
        if h.frames is not None:  # its requests finish on the connection; then it closes
            fut_frames = asyncio.ensure_future(h.frames.close(grace_s))
            self._closing.add(fut_frames)
            fut_frames.add_done_callback(self._closing.discard)
            h.frames = None
        fut = asyncio.ensure_future(h.channel.close(grace_s))
        self._closing.add(fut)
        fut.add_done_callback(self._closing.discard)
        log.info("worker %s (%s) removed from the pool", h.view.id, address)
        return h

    def addresses(self) -> set[str]:
        return {h.address for h in self.handles}

    async def start(self, settle_s: float = STARTUP_SETTLE_S) -> None:
        self._started = True
        self._settled_by = time.monotonic() + settle_s
        m.WORKERS_ROUTABLE.set_function(lambda: self.routable_count(time.monotonic()))  # read at scrape time
        self._tasks = {h.address: asyncio.create_task(self._follow(h)) for h in self.handles}

    async def settle(self) -> None:
        """In the first `settle_s` after `start`, waits until every worker has reported (or that window
        ends). A process of `--processes N` listens before it knows its workers, and the kernel hands it
        connections beside serving siblings: without this wait it answered "no worker available", or routed
        on the workers that happened to report first. Once settled (or past the window) it returns at once."""
        if self.ready.is_set():
            return
        left = self._settled_by - time.monotonic()
        if left > 0:
            await self.wait_ready(left)

    async def wait_ready(self, timeout_s: float) -> bool:
        """Waits until every worker has sent a load report (or `timeout_s`); True if all did."""
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(self.ready.wait(), timeout_s)
        return self.ready.is_set()

    async def stop(self) -> None:
        self._stopping.set()
        for t in self._tasks.values():
            t.cancel()
        for t in self._tasks.values():
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await t
        for h in self.handles:
            await h.stream.close()
            if h.frames is not None:
                await h.frames.close()
            await h.channel.close()
        for c in list(self._closing):
            c.cancel()

    def views(self, now: float) -> list[WorkerView]:
        """Views of every known worker; stale ones are marked unhealthy; circuit state as of `now`."""
        out = []
        for h in self.handles:
            v = h.view
            if not v.id:
                continue
            if v.healthy and now - h.last_report_rx > self.stale_after_s:
                v.healthy = False
                log.warning(
                    "worker %s (%s) out of rotation: no load report for %.1f s", v.id, h.address, now - h.last_report_rx
                )
            v.circuit = h.breaker.view_state(now)
            out.append(v)
        return out

    def routable_count(self, now: float) -> int:
        """Workers the profile may pick from: healthy, not draining, circuit not open."""
        return sum(1 for v in self.views(now) if v.routable)

    def mark_failed(self, worker_id: str, now: float, reason: str) -> None:
        """A call to the worker failed at the transport level: out of rotation until it reports again."""
        h = self.by_id.get(worker_id)
        if h is None:
            return
        h.view.healthy = False
        h.breaker.force_open(now, reason)

    async def _follow(self, h: WorkerHandle) -> None:
        backoff = 0.05
        while not self._stopping.is_set():
            try:
                info = await h.stub.GetInfo(worker_pb2.GetInfoRequest(), timeout=2.0)
                if not self._agrees(h, info):
                    raise _Disagrees
                self._on_info(h, info)
                stream = h.stub.StreamLoad(worker_pb2.StreamLoadRequest(interval_ms=self.load_interval_ms))
                async for msg in stream:
                    self._on_report(h, msg.report)
                    backoff = 0.05
            except asyncio.CancelledError:
                raise
            except grpc.aio.AioRpcError as e:
                if h.view.healthy:
                    log.warning("worker %s (%s) out of rotation: %s", h.view.id, h.address, e.code().name)
            except _Disagrees:
                pass  # logged by _agrees; asked again after the back-off (it may restart with the right flag)
            except Exception:
                log.exception("worker %s load stream failed", h.address)
            if h.frames is not None:
                h.frames.reset("load stream lost")
            if h.view.id and h.view.healthy:
                h.view.healthy = False
                h.breaker.force_open(time.monotonic(), "load stream lost")
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._stopping.wait(), backoff)
            backoff = min(backoff * 2, 2.0)

    def _agrees(self, h: WorkerHandle, info: worker_pb2.GetInfoResponse) -> bool:
        """False (logged once per new reason) if the worker's block size differs from the router's, or it does
        not serve `GenerateStream` (older than the router's transports: it would get no request)."""
        unknown = not (self.block_size and info.block_size)  # 0: no check asked, or an older worker
        peer = f"worker {info.worker_id or h.address} ({h.address})"
        problems = disagreements(peer, [Agreed("--block-size", self.block_size, info.block_size, unknown=unknown)])
        if not info.generate_stream:
            problems.append(f"{peer} does not serve GenerateStream, the router's transport: upgrade the worker")
        reason = "; ".join(problems)
        if reason and reason != h.disagreement:
            log.error("not routing to the worker: %s", reason)
        h.disagreement = reason
        return not reason

    def _on_info(self, h: WorkerHandle, info: worker_pb2.GetInfoResponse) -> None:
        wid = info.worker_id or h.address
        if h.view.id and h.view.id != wid:
            self.by_id.pop(h.view.id, None)
            self.tracker.forget_worker(h.view.id)
        h.view.id = wid
        h.view.zone = info.zone
        h.view.version = info.version
        h.view.kv_blocks_total = info.kv_blocks_total
        h.model = info.model
        h.max_model_len = info.max_model_len
        self._use_frames(h, info.generate_frames_address)
        h.view.kvsync_address, h.view.tier_region = info.kvsync_address, info.tier_region
        h.view.tier_shm_name = info.tier_shm_name
        h.view.transfer = transfer_from_proto(info.transfer) if info.HasField("transfer") else None
        h.view.role = role_from_proto(info.role)
        h.view.host, h.view.rack, h.view.engine_handoff = info.host, info.rack, info.engine_handoff
        self.by_id[wid] = h

    def _use_frames(self, h: WorkerHandle, address: str) -> None:
        """Generate frames to `address` (the worker's GetInfo; a restarted worker may have a new port)."""
        if self.transport != "frames" or (h.frames is not None and h.frames.address == address):
            return
        if h.frames is not None:
            h.frames.reset("the worker moved its generate frames")
        h.frames = FramedWorkerStream(address, self._settings) if address else None
        h.frames_off_until = float("-inf")

    def _on_report(self, h: WorkerHandle, r: common_pb2.LoadReport) -> None:
        now = time.monotonic()
        h.view.apply_report(load_from_proto(r))
        h.view.report_ts = now
        h.last_report = r
        h.last_report_rx = now
        if not h.view.healthy:
            h.view.healthy = True
            log.info("worker %s (%s) in rotation", h.view.id, h.address)
        self.tracker.on_report(h.view.id, now)
        if not self.ready.is_set() and all(x.last_report_rx > float("-inf") for x in self.handles):
            self.ready.set()
