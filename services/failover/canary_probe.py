"""Measures versions for the canary (the I/O half of `kvmesh.ops.rollout.canary`): probes their workers over gRPC.

Per version, at each check: every worker's `GetInfo` (KV pool = kv_blocks_total × block_size tokens) and its
first `StreamLoad` report (live error rate, median decode-step latency), averaged over the version's workers;
then the fixed probe set, each prompt sent greedily (temperature 0, `ignore_eos`) to one worker of each
version (probe p to worker p mod n), the versions' order alternating from probe to probe so that load on the
host weighs on both alike. A failed or timed-out probe counts as an error and gives no output.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable, Mapping, Sequence

import grpc
import grpc.aio

from kvmesh.discovery.model import ServiceInstance
from kvmesh.ops.rollout.canary import VersionSample
from kvmesh.v1 import common_pb2, worker_pb2, worker_pb2_grpc

log = logging.getLogger(__name__)


class VersionProber:
    def __init__(
        self,
        channel_for: Callable[[str], grpc.aio.Channel],
        prompts: Sequence[Sequence[int]],
        max_tokens: int,
        timeout_s: float,
    ) -> None:
        self._channel_for = channel_for
        self._channels: dict[str, grpc.aio.Channel] = {}
        self.prompts = [list(p) for p in prompts]
        self.max_tokens = max_tokens
        self.timeout_s = timeout_s
        self._seq = 0

    def _stub(self, target: str) -> worker_pb2_grpc.WorkerServiceStub:
        if target not in self._channels:
            self._channels[target] = self._channel_for(target)
        return worker_pb2_grpc.WorkerServiceStub(self._channels[target])

    async def close(self) -> None:
        for ch in self._channels.values():
            await ch.close()
        self._channels.clear()

    async def measure(self, workers: Mapping[str, Sequence[ServiceInstance]]) -> dict[str, VersionSample]:
        """One `VersionSample` per version of `workers` ({version: its up workers})."""
        versions = sorted(workers)
        reports = {v: await asyncio.gather(*(self._report(w) for w in workers[v])) for v in versions}
        outputs: dict[str, dict[int, list[int]]] = {v: {} for v in versions}
        latencies: dict[str, list[float]] = {v: [] for v in versions}
        errors = dict.fromkeys(versions, 0)
        for p, prompt in enumerate(self.prompts):
            order = versions if p % 2 == 0 else versions[::-1]
            for v in order:
                if not workers[v]:
                    continue
                got = await self._probe(workers[v][p % len(workers[v])], prompt)
                if got is None:
                    errors[v] += 1
                else:
                    outputs[v][p], took = got
                    latencies[v].append(took)
        out = {}
        for v in versions:
            infos = [r for r in reports[v] if r is not None]
            p50s = [r[2] for r in infos if r[2] > 0]
            out[v] = VersionSample(
                outputs=outputs[v],
                latencies_s=latencies[v],
                probes=len(self.prompts) if workers[v] else 0,
                probe_errors=errors[v],
                kv_tokens=sum(r[0] for r in infos) / len(infos) if infos else 0.0,
                live_error_rate=sum(r[1] for r in infos) / len(infos) if infos else 0.0,
                live_decode_p50_ms=sum(p50s) / len(p50s) if len(p50s) == len(infos) and p50s else 0.0,
                workers=len(workers[v]),
            )
        return out

    async def _report(self, w: ServiceInstance) -> tuple[float, float, float] | None:
        """(KV pool tokens, live error rate, live decode p50 ms) of one worker; None when it does not answer."""
        stub = self._stub(w.target)
        try:
            info = await stub.GetInfo(worker_pb2.GetInfoRequest(), timeout=self.timeout_s)
            call = stub.StreamLoad(worker_pb2.StreamLoadRequest(), timeout=self.timeout_s)
            try:
                first = await call.read()
            finally:
                call.cancel()
        except grpc.aio.AioRpcError as e:
            log.warning("canary: worker %s (%s) did not report: %s", w.id, w.target, e.code().name)
            return None
        if not isinstance(first, worker_pb2.StreamLoadResponse):
            return None
        r = first.report
        return float(info.kv_blocks_total * info.block_size), r.error_rate, r.decode_latency_p50_ms

    async def _probe(self, w: ServiceInstance, prompt: list[int]) -> tuple[list[int], float] | None:
        self._seq += 1
        req = worker_pb2.GenerateRequest(
            request_id=f"canary-probe-{self._seq}",
            token_ids=common_pb2.TokenIds(ids=prompt),
            sampling=common_pb2.SamplingParams(max_tokens=self.max_tokens, temperature=0.0, ignore_eos=True),
        )
        tokens: list[int] = []
        t0 = time.perf_counter()
        try:
            async for msg in self._stub(w.target).Generate(req, timeout=self.timeout_s):
                tokens.extend(msg.token_ids)
        except grpc.aio.AioRpcError as e:
            log.warning("canary: probe on worker %s failed: %s %s", w.id, e.code().name, e.details())
            return None
        return tokens, time.perf_counter() - t0
