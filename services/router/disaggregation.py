"""The router's side of prefill/decode disaggregation: a disaggregated request's prefill half, and what the
decode half is sent with (docs/disaggregation.md).

Placement decides per request (`kvmesh.routing.disagg.decide`, on the same query and views the routing
profile sees); a disaggregated decision names a prefill worker p and a decode worker d. Then:

1. the prefill half goes to p: the request's prompt, tenant and LoRA (the same block salts), `prefill_only`,
   `max_tokens` 1, `hand_off_ms` = the hold; p computes the prompt's KV, holds it and ends with a `KvHandoff`;
2. the decode half goes to d as an ordinary attempt with the handoff: vLLM's kv_transfer_params when d hands
   over by its engine too (NIXL), else the kv-sync pull from p's tier as its `kv_pull` (the one pull path).
   The client's stream is the decode half's; its `cached_tokens` are what p found cached.

Every failure ends in aggregated serving, never in a stream that hangs: p failing or passing the prefill
deadline → the request is routed again without P/D, p excluded (`fallback` "prefill_failed" /
"prefill_timeout"); a prefill half that ends without a usable handoff → the decode half computes the prompt
("no_handoff"); a handoff whose load fails on d → d computes (the worker's pull is best effort). Retries and
migrations after the decode half's first attempt run aggregated.
"""

from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass

import grpc

from kvmesh.core.handoff import KvHandoff
from kvmesh.routing import InflightTracker
from kvmesh.routing.attempts import Failure
from kvmesh.services.router import metrics as m
from kvmesh.services.router.request import RouterRequest
from kvmesh.services.router.worker_stream import classify, close_call, worker_request_bytes
from kvmesh.services.router.workers import WorkerPool
from kvmesh.v1 import common_pb2, worker_pb2
from kvmesh.wire.proto import handoff_from_proto

log = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class PdSettings:
    """The router's P/D bounds: `enabled` (False: every request aggregated), the hold asked of prefill
    workers and the prefill half's deadline, in ms."""

    enabled: bool = True
    hold_ms: int = 10_000
    prefill_timeout_ms: int = 30_000


@dataclass(frozen=True, slots=True)
class PrefillHalf:
    """A disaggregated decision's prefill worker, and the prompt tokens it has to compute."""

    worker_id: str
    n_new: int


@dataclass(frozen=True, slots=True)
class HandedOver:
    """What a prefill half produced: the handoff (None: nothing to load) or the fallback's cause."""

    handoff: KvHandoff | None
    fallback: str = ""


def pd_eligible(req: RouterRequest, so_far: list[int]) -> bool:
    """Whether a request may run disaggregated: its first attempt (a retry or migration runs aggregated),
    and no prompt log-probabilities (only a worker that computes the prompt itself can give them)."""
    return not so_far and not req.sampling.prompt_logprobs


def prefill_request(rid: str, req: RouterRequest, hold_ms: int) -> bytes:
    """Wire bytes of the prefill half: the prompt (its salts: tenant, LoRA), one token at most, the hold."""
    head = worker_pb2.GenerateRequest(
        request_id=rid,
        tenant=req.tenant,
        lora_name=req.lora,
        prefill_only=True,
        hand_off_ms=hold_ms,
        sampling=common_pb2.SamplingParams(max_tokens=1, temperature=0.0),
    )
    return worker_request_bytes(head, req.prompt.wire)


class Disaggregation:
    """Runs prefill halves on the pool's prefill workers and accounts for them."""

    def __init__(self, settings: PdSettings, pool: WorkerPool, tracker: InflightTracker) -> None:
        self.settings, self.pool, self.tracker = settings, pool, tracker

    async def prefill(self, rid: str, req: RouterRequest, half: PrefillHalf, block_size: int) -> HandedOver:
        """Runs the prefill half on `half.worker_id`; never raises for the worker's failures (a fallback)."""
        h = self.pool.by_id.get(half.worker_id)
        if h is None:
            return HandedOver(None, "prefill_failed")
        prid = f"{rid}.prefill"
        now = time.monotonic()
        h.selections_total += 1
        h.breaker.on_dispatch(now)
        self.tracker.assign(prid, half.worker_id, half.n_new, len(req.prompt), block_size, now)
        t0 = time.perf_counter()
        call = None
        handoff: worker_pb2.KvHandoff | None = None
        try:
            async with asyncio.timeout(self.settings.prefill_timeout_ms / 1000.0):
                call = await h.generate(prid, prefill_request(prid, req, self.settings.hold_ms), {})
                async for resp in call:
                    if resp.HasField("handoff"):
                        handoff = resp.handoff
        except TimeoutError:
            self._failed(half.worker_id, "prefill_timeout")
            return HandedOver(None, "prefill_timeout")
        except grpc.aio.AioRpcError as e:
            log.info("request %s: prefill half on %s failed: %s", rid, half.worker_id, e.code().name)
            if classify(e, call) is Failure.WORKER:  # a refusal (full queue, bad request) is no worker fault
                self._failed(half.worker_id, "prefill_failed")
            else:
                m.PD_FALLBACKS.labels("prefill_refused").inc()
            return HandedOver(None, "prefill_failed")
        finally:
            close_call(call, handoff is not None)  # cancelled there unless it ended
            self.tracker.finish(prid)
        elapsed = time.perf_counter() - t0
        # the breaker samples inter-token gaps (its measured phase, `StreamClock`): a prefill half has none, and
        # its duration grows with the prompt and the queue, no sign of a sick worker
        h.breaker.record(time.monotonic(), 0.0, True)
        m.PD_PREFILL_SECONDS.observe(elapsed)
        if handoff is None or not handoff.num_blocks:
            m.PD_FALLBACKS.labels("no_handoff").inc()
            return HandedOver(None, "no_handoff")
        m.PD_HANDOFF_BLOCKS.inc(handoff.num_blocks)
        return HandedOver(handoff_from_proto(handoff))

    def _failed(self, wid: str, cause: str) -> None:
        m.PD_FALLBACKS.labels(cause).inc()
        self.pool.mark_failed(wid, time.monotonic(), cause)
