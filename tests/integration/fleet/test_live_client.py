"""The live-replay client (``kvmesh.fleet.live``) against a scripted in-process router on loopback.

The fake router streams with known wall delays, so the client's conversions can be checked: at speed S,
simulated time = S × wall time. Timing assertions are lower bounds (sleeps guarantee them) with an upper
bound loose enough for a loaded machine yet below what a conversion off by the factor S would give; nothing
sleeps to synchronise.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator

import grpc
import pytest

from kvmesh.fleet.live import LiveConfig, agreement, replay
from kvmesh.fleet.trace import Trace, TraceRequest, prompt_tokens
from kvmesh.v1 import common_pb2, router_pb2, router_pb2_grpc

pytestmark = pytest.mark.integration
SPEED = 10.0
FIRST_S, GAP_S, CACHED = 0.1, 0.01, 512  # wall seconds before the first token / between tokens


class FakeRouter(router_pb2_grpc.RouterServiceServicer):
    """Request live-0/1: served; live-2: RESOURCE_EXHAUSTED; live-3: never answers (a hung worker)."""

    def __init__(self) -> None:
        self.seen: dict[int, tuple[float, router_pb2.RouterServiceGenerateRequest]] = {}
        self.never = asyncio.Event()

    async def Generate(
        self, request: router_pb2.RouterServiceGenerateRequest, context: grpc.aio.ServicerContext
    ) -> AsyncIterator[router_pb2.RouterServiceGenerateResponse]:
        i = int(request.request_id.removeprefix("live-"))
        self.seen[i] = (time.monotonic(), request)
        if i == 2:
            await context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, "full")
        if i == 3:
            await self.never.wait()
        n = request.sampling.max_tokens
        await asyncio.sleep(FIRST_S)
        for k in range(n):
            if k:
                await asyncio.sleep(GAP_S)
            last = k == n - 1
            yield router_pb2.RouterServiceGenerateResponse(
                token_ids=[7],
                worker_id=f"w{i % 2}",
                finish_reason=common_pb2.FINISH_REASON_LENGTH if last else common_pb2.FINISH_REASON_UNSPECIFIED,
                usage=common_pb2.Usage(
                    prompt_tokens=len(request.token_ids.ids), cached_tokens=CACHED, completion_tokens=n
                )
                if last
                else None,
            )


def small_trace() -> Trace:
    reqs = [
        TraceRequest(i, arrival_s=float(i), input_len=600 + i, output_len=5, chunks=(10 * i + 1, 10 * i + 2))
        for i in range(5)
    ]
    return Trace("fake", reqs)


async def test_replay_converts_time_counts_errors_and_honours_bounds() -> None:
    server = grpc.aio.server()
    fake = FakeRouter()
    router_pb2_grpc.add_RouterServiceServicer_to_server(fake, server)
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    trace = small_trace()
    try:
        res = await replay(trace, f"127.0.0.1:{port}", LiveConfig(speed=SPEED, max_requests=4, max_wall_s=1.5))
    finally:
        await server.stop(grace=0)
    assert sorted(fake.seen) == [0, 1, 2, 3]  # max_requests: request 4 never sent
    for i, (_, req) in fake.seen.items():
        r = trace.requests[i]
        assert list(req.token_ids.ids) == prompt_tokens(r).tolist()
        assert req.sampling.max_tokens == r.output_len and req.sampling.ignore_eos
    # arrivals 1 s of trace apart are sent 1/S s of wall apart; records carry the scheduled (simulated) time
    gaps = [fake.seen[i + 1][0] - fake.seen[i][0] for i in range(3)]
    assert all(1 / SPEED - 0.02 <= g <= 6 / SPEED for g in gaps), gaps  # unscaled: 1 s apart
    assert [rec.arrival for rec in res.records] == pytest.approx([0.0, 1.0, 2.0, 3.0])
    ok = [res.records[0], res.records[1]]
    for rec in ok:
        assert SPEED * FIRST_S <= rec.ttft < 8 * SPEED * FIRST_S  # scaled twice: 10 x
        assert SPEED * GAP_S <= rec.itl < 8 * SPEED * GAP_S
        assert rec.cached_tokens == CACHED and rec.worker in ("w0", "w1")
    assert dict(res.errors) == {"RESOURCE_EXHAUSTED": 1}
    assert res.truncated  # request 3 hung until the wall deadline
    s = res.summary
    assert s["requests"] == 2 and s["unfinished"] == 2 and s["errors"] == 1 and s["truncated"]
    assert s["hit_ratio"] == pytest.approx(2 * CACHED / (600 + 601))
    assert "util_mean" not in s and s["workers_used"] == {"w0": 1, "w1": 1}
    a = agreement(s, {**s, "hit_ratio": s["hit_ratio"] - 0.01})
    assert a["ttft_ms_ratio"]["p50"] == 1.0 and a["hit_ratio_diff"] == pytest.approx(0.01)
