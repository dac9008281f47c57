"""Worker servicer: proto <-> domain over an Engine (kvmesh.engine)."""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import socket
import time
from collections.abc import AsyncIterator

import grpc

from kvmesh.core.errors import PermissionDenied
from kvmesh.core.generation import EngineRequest
from kvmesh.core.pull import KvPull
from kvmesh.core.sampling import check_extensions, check_temperature, check_top_p
from kvmesh.rpc.validate import non_empty, require
from kvmesh.security.identity import current_identity
from kvmesh.services.worker import metrics as m
from kvmesh.services.worker.app import WorkerApp
from kvmesh.services.worker.generate_stream import GenerateStreamSession
from kvmesh.services.worker.handoff import HandoffHolds, HandoffSource, check_halves, handed_over
from kvmesh.services.worker.kvlog import Cursor
from kvmesh.services.worker.settings import WorkerSettings
from kvmesh.v1 import common_pb2, worker_pb2, worker_pb2_grpc
from kvmesh.wire.proto import (
    batch_to_proto,
    dump_messages,
    load_to_proto,
    output_to_proto,
    pull_from_proto,
    request_from_proto,
    role_to_proto,
    sampling_from_proto,
)

LIVE = common_pb2.KV_STREAM_KIND_LIVE


def validate_generate(request: worker_pb2.GenerateRequest) -> None:
    """Checks a generation request before the engine sees it."""
    non_empty(request.request_id, "request_id")
    kind = request.WhichOneof("prompt")
    require(kind is not None, "prompt", "one of token_ids or text is required")
    if kind == "token_ids":
        non_empty(request.token_ids.ids, "token_ids.ids")
        # at least one token of the original prompt precedes the output a request resumes from
        n_ids = len(request.token_ids.ids)
        require(
            request.resumed_output_tokens < n_ids,
            "resumed_output_tokens",
            f"must be below the prompt's {n_ids} tokens (they end with the output so far)",
        )
    check_temperature(request.sampling.temperature, "sampling.temperature")
    check_top_p(request.sampling.top_p, "sampling.top_p", zero_means_unset=True)
    # n, log-probabilities, token lists, the structured output: refused here, before a pull or the batching
    # window spends anything on the request (the engine checks its own limits, e.g. its vocabulary)
    check_extensions(sampling_from_proto(request.sampling))


async def next_or_stop(
    cursor: Cursor, stopping: asyncio.Event, ended: asyncio.Future[object] | None = None
) -> common_pb2.KvEventBatch | None:
    """The cursor's next batch as proto, or None once `stopping` is set or `ended` (e.g. the peer's call
    terminating) completes."""
    get = asyncio.ensure_future(cursor.queue.get())
    stop = asyncio.ensure_future(stopping.wait())
    waits: set[asyncio.Future[object]] = {get, stop}  # type: ignore[arg-type]
    if ended is not None:
        waits.add(ended)
    try:
        done, _ = await asyncio.wait(waits, return_when=asyncio.FIRST_COMPLETED)
        return batch_to_proto(get.result()) if get in done else None
    finally:
        for f in (get, stop):
            if not f.done():
                f.cancel()


class WorkerServicer(worker_pb2_grpc.WorkerServiceServicer):
    """One engine behind gRPC."""

    def __init__(self, app: WorkerApp, settings: WorkerSettings, holds: HandoffHolds | None = None) -> None:
        self.app = app
        self.settings = settings
        self.holds = holds  # the handoff holds on the served tier (None: no tier, nothing to hold)
        self.owners: dict[str, str] = {}  # request id in flight -> the identity that started it (auth on)

    def Generate(  # type: ignore[override]
        self, request: worker_pb2.GenerateRequest, context: grpc.aio.ServicerContext
    ) -> AsyncIterator[worker_pb2.GenerateResponse]:
        """Streams deltas; cancellation or the deadline closes the engine stream, which aborts the request.
        Returns `outputs(request)` itself (the per-call instrumentation iterates it): no extra generator layer
        per streamed step."""
        return self.outputs(request)

    async def GenerateStream(  # type: ignore[override]
        self, request_iterator: AsyncIterator[worker_pb2.GenerateStreamRequest], context: grpc.aio.ServicerContext
    ) -> AsyncIterator[worker_pb2.GenerateStreamResponse]:
        """Generate requests multiplexed on one stream (`kvmesh.services.worker.generate_stream`)."""
        async for msg in GenerateStreamSession(self.outputs, self.app.stopping).run(request_iterator):
            yield msg

    async def outputs(self, request: worker_pb2.GenerateRequest) -> AsyncIterator[worker_pb2.GenerateResponse]:
        """One request's steps, as both Generate and GenerateStream send them."""
        validate_generate(request)
        check_halves(request, self.settings.worker_role)
        req = request_from_proto(request)
        if req.hand_off_ms:  # a prefill half: its KV, no tokens
            req = dataclasses.replace(req, prefill_only=True)
        timer = m.StreamTimer(time.monotonic())
        engine = self.app.engine
        pull = self._pull_of(request, req)
        if pull is not None:  # a pull that fails is no pull: those blocks are computed
            pulled = await engine.pull_prefix(req, pull)
            m.observe_pull(pulled)
            if pulled.load is not None:
                req = dataclasses.replace(req, kv_pull=pulled.load)
        if self.app.gate is not None:  # the batching window: enter the engine in its release order
            await self.app.gate.admit(req)
        owner = self._own(request.request_id)
        stream = engine.generate(req)
        try:
            async for out in stream:
                if req.hand_off_ms:
                    out = await handed_over(engine, req, out, self.holds, self._source())
                timer.tokens(time.monotonic(), len(out.token_ids))
                if out.finished:
                    m.observe_finished(out.usage, out.finish_reason)
                yield output_to_proto(out, self.app.worker_id, request.detokenize)
        finally:
            if owner is not None and self.owners.get(request.request_id) == owner:
                del self.owners[request.request_id]
            await stream.aclose()

    @staticmethod
    def _pull_of(request: worker_pb2.GenerateRequest, req: EngineRequest) -> KvPull | None:
        """The pull to load the prompt's leading blocks by: the router's `kv_pull`, else a decode half's
        kv-sync handoff (the router copies it into `kv_pull`; a caller that does not is served the same)."""
        if request.HasField("kv_pull"):
            return pull_from_proto(request.kv_pull)
        return req.handoff.pull if req.handoff is not None else None

    def _source(self) -> HandoffSource:
        """Where decode workers pull this worker's handed-over blocks from."""
        app = self.app
        return HandoffSource(app.worker_id, app.kvsync_address, app.tier_region, app.tier_shm_name)

    def _own(self, request_id: str) -> str | None:
        """Record the caller (when known) as the starter of `request_id`, the one that may abort it; an id in
        flight for another caller is refused (reusing it would take the request over)."""
        caller = current_identity()
        if caller is None:
            return None
        who = str(caller)
        if self.owners.setdefault(request_id, who) != who:
            raise PermissionDenied(f"request_id: {request_id!r} is in flight for another caller; pick a fresh id")
        return who

    async def Abort(  # type: ignore[override]
        self, request: worker_pb2.AbortRequest, context: grpc.aio.ServicerContext
    ) -> worker_pb2.AbortResponse:
        """With authentication, a caller aborts only requests it started: requests are keyed by (starter,
        request id), so another caller's id, guessed or seen, is refused and the request runs on."""
        non_empty(request.request_id, "request_id")
        caller, rid = current_identity(), request.request_id
        if caller is not None and self.owners.get(rid) != str(caller):
            if rid in self.owners:
                raise PermissionDenied(
                    f"request_id: caller {caller} did not start request {rid!r}; only its starter aborts it"
                )
            return worker_pb2.AbortResponse(aborted=False)
        return worker_pb2.AbortResponse(aborted=await self.app.engine.abort(rid))

    async def StreamLoad(  # type: ignore[override]
        self, request: worker_pb2.StreamLoadRequest, context: grpc.aio.ServicerContext
    ) -> AsyncIterator[worker_pb2.StreamLoadResponse]:
        interval = (request.interval_ms or self.settings.load_interval_ms) / 1000.0
        stopping = self.app.stopping
        while not stopping.is_set():
            yield worker_pb2.StreamLoadResponse(report=load_to_proto(self.app.load()))
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(stopping.wait(), interval)

    async def StreamKvEvents(  # type: ignore[override]
        self, request: worker_pb2.StreamKvEventsRequest, context: grpc.aio.ServicerContext
    ) -> AsyncIterator[worker_pb2.StreamKvEventsResponse]:
        """Replay from start_sequence when this instance still buffers it, else a full dump first; then live
        batches. A consumer that falls behind gets a fresh dump in-stream."""
        log = self.app.log
        cursor = log.open_cursor()
        try:
            replay = None
            if request.start_sequence and request.instance_id == log.instance_id:
                replay = log.replay(request.start_sequence)
            sent = 0
            if replay is None:
                sent = log.last_seq  # the dump is the state after this batch
                for msg in self._dump():
                    yield msg
            else:
                sent = request.start_sequence - 1
                for b in replay:
                    yield worker_pb2.StreamKvEventsResponse(kind=LIVE, batch=batch_to_proto(b))
                    sent = b.sequence
            while not self.app.stopping.is_set():
                if cursor.lost:
                    log.close_cursor(cursor)
                    cursor = log.open_cursor()
                    sent = log.last_seq
                    for msg in self._dump():
                        yield msg
                batch = await next_or_stop(cursor, self.app.stopping)
                if batch is None:
                    return
                if batch.sequence <= sent:
                    continue
                yield worker_pb2.StreamKvEventsResponse(kind=LIVE, batch=batch)
                sent = batch.sequence
        finally:
            log.close_cursor(cursor)

    def _dump(self) -> list[worker_pb2.StreamKvEventsResponse]:
        log = self.app.log
        seq, blocks = log.dump()
        return [
            worker_pb2.StreamKvEventsResponse(kind=kind, batch=b)
            for kind, b in dump_messages(log.worker_id, log.instance_id, seq, blocks, time.time())
        ]

    async def GetInfo(  # type: ignore[override]
        self, request: worker_pb2.GetInfoRequest, context: grpc.aio.ServicerContext
    ) -> worker_pb2.GetInfoResponse:
        eng = self.app.engine
        return worker_pb2.GetInfoResponse(
            worker_id=self.app.worker_id,
            engine=self.app.engine_kind,
            model=eng.model_name,
            block_size=eng.block_size,
            kv_blocks_total=eng.load_report().kv_blocks_total,
            max_model_len=eng.max_model_len,
            instance_id=self.app.instance_id,
            zone=self.settings.zone,
            version=self.settings.version,
            generate_stream=True,
            kvsync_address=self.app.kvsync_address,
            generate_frames_address=self.app.frames_address,
            tier_region=self.app.tier_region,
            tier_shm_name=self.app.tier_shm_name,
            tier_blocks_total=self.app.tier_blocks_total,
            tier_block_bytes=self.app.tier_block_bytes,
            transfer=self._transfer(),
            role=role_to_proto(self.settings.worker_role),
            host=self.settings.host_label or socket.gethostname(),
            rack=self.settings.rack_label,
            engine_handoff=self.app.engine_handoff,
        )

    def _transfer(self) -> worker_pb2.KvTransferCosts | None:
        """The KV transfer costs the router prices this worker with (its engine's); None without a served tier
        (no data plane: it neither loads nor pulls)."""
        if not self.app.kvsync_address:
            return None
        c = self.app.engine.transfer_costs()
        return worker_pb2.KvTransferCosts(
            prefill_s_per_token=c.prefill_s_per_token,
            block_load_s=c.block_load_s,
            block_pull_s=c.block_pull_s,
            pull_rtt_s=c.pull_rtt_s,
        )
