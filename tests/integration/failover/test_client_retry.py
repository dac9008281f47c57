"""kvmesh.client retry / resume rules, against STAND-IN routers (in-process gRPC servers of RouterService).

The stand-in routers exist to inject failures at exact points (before the first token, after n
tokens), which real routers cannot be told to do; the full path with real routers is in
test_failover_client.py. Tokens are a pure function of the prompt and position, and a stand-in
refuses a resume whose `resume_token_ids` is not the exact prefix, so duplicates or gaps fail.
"""

from __future__ import annotations

import random
import time
from collections.abc import AsyncIterator

import grpc
import grpc.aio
import pytest

from kvmesh.client import AsyncClient
from kvmesh.core.errors import DeadlineExceeded, Unavailable
from kvmesh.v1 import common_pb2, router_pb2, router_pb2_grpc

pytestmark = pytest.mark.integration


def token(prompt: list[int], k: int) -> int:
    return (sum(prompt) * 31 + k * 7) % 50000


class StandinRouter(router_pb2_grpc.RouterServiceServicer):
    """STAND-IN router: `fail_before` calls abort UNAVAILABLE at once; `break_after` tokens then abort."""

    def __init__(self, name: str) -> None:
        self.name = name
        self.fail_before = 0
        self.down_until = 0.0  # time.monotonic() before which every call is UNAVAILABLE (no worker in its zone)
        self.break_after: int | None = None
        self.calls: list[list[int]] = []

    async def Generate(  # type: ignore[override]
        self, request: router_pb2.RouterServiceGenerateRequest, context: grpc.aio.ServicerContext
    ) -> AsyncIterator[router_pb2.RouterServiceGenerateResponse]:
        prompt = list(request.token_ids.ids)
        resume = list(request.resume_token_ids)
        self.calls.append(resume)
        if self.fail_before > 0:
            self.fail_before -= 1
            await context.abort(grpc.StatusCode.UNAVAILABLE, f"{self.name}: down")
        if time.monotonic() < self.down_until:
            await context.abort(grpc.StatusCode.UNAVAILABLE, f"{self.name}: no worker available")
        if resume != [token(prompt, k) for k in range(len(resume))]:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, "resume tokens are not the exact prefix")
        n = request.sampling.max_tokens
        for k in range(len(resume), n):
            if self.break_after is not None and k - len(resume) >= self.break_after:
                self.break_after = None
                await context.abort(grpc.StatusCode.UNAVAILABLE, f"{self.name}: broke mid-stream")
            last = k == n - 1
            yield router_pb2.RouterServiceGenerateResponse(
                token_ids=[token(prompt, k)],
                worker_id=self.name,
                request_id=request.request_id,
                finish_reason=common_pb2.FINISH_REASON_LENGTH if last else common_pb2.FINISH_REASON_UNSPECIFIED,
            )


@pytest.fixture
async def routers() -> AsyncIterator[list[tuple[StandinRouter, str]]]:
    out, servers = [], []
    for name in ("r1", "r2"):
        server = grpc.aio.server()
        svc = StandinRouter(name)
        router_pb2_grpc.add_RouterServiceServicer_to_server(svc, server)
        port = server.add_insecure_port("127.0.0.1:0")
        await server.start()
        servers.append(server)
        out.append((svc, f"127.0.0.1:{port}"))
    yield out
    for s in servers:
        await s.stop(0)


def req(n: int) -> router_pb2.RouterServiceGenerateRequest:
    return router_pb2.RouterServiceGenerateRequest(
        token_ids=common_pb2.TokenIds(ids=[1, 2, 3]), sampling=common_pb2.SamplingParams(max_tokens=n)
    )


EXPECTED = [token([1, 2, 3], k) for k in range(20)]


class Fixed(random.Random):
    """A "random" source that always returns `u`, to make the weighted pick deterministic."""

    def __init__(self, u: float) -> None:
        super().__init__(0)
        self.u = u

    def random(self) -> float:
        return self.u


async def test_retry_before_first_token_goes_to_another_router(routers: list[tuple[StandinRouter, str]]) -> None:
    (r1, a1), (r2, a2) = sorted(routers, key=lambda r: r[1])  # static sets are ordered by address
    r1.fail_before = 1
    async with AsyncClient(routers=[a1, a2], rng=Fixed(0.1)) as c:  # u=0.1 picks the first: r1
        msgs = [m async for m in c.generate(req(20))]
    assert [t for m in msgs for t in m.token_ids] == EXPECTED
    assert c.attempts_total == 2 and c.resumes_total == 0
    assert len(r1.calls) == 1 and len(r2.calls) == 1  # the second attempt went to the other router


async def test_broken_stream_resumes_with_received_tokens(routers: list[tuple[StandinRouter, str]]) -> None:
    (r1, a1), (r2, a2) = routers
    r1.break_after = r2.break_after = 7
    async with AsyncClient(routers=[a1, a2]) as c:
        msgs = [m async for m in c.generate(req(20))]
    tokens = [t for m in msgs for t in m.token_ids]
    assert tokens == EXPECTED  # one stream: no duplicate, no gap
    assert msgs[-1].finish_reason == common_pb2.FINISH_REASON_LENGTH
    assert c.resumes_total == 2  # both routers broke once, after 7 tokens each
    resumes = sorted(len(x) for r in (r1, r2) for x in r.calls)
    assert resumes == [0, 7, 14]


async def test_gives_up_after_bounded_attempts(routers: list[tuple[StandinRouter, str]]) -> None:
    (r1, a1), (r2, a2) = routers
    r1.fail_before = r2.fail_before = 100
    async with AsyncClient(routers=[a1, a2], max_attempts=4) as c:
        with pytest.raises(Unavailable):
            _ = [m async for m in c.generate(req(5))]
    assert len(r1.calls) + len(r2.calls) == 4


async def test_caller_errors_are_not_retried(routers: list[tuple[StandinRouter, str]]) -> None:
    (r1, a1), _ = routers
    bad = req(5)
    bad.resume_token_ids.extend([999999])  # not the prefix: INVALID_ARGUMENT
    async with AsyncClient(routers=[a1]) as c:
        with pytest.raises(grpc.aio.AioRpcError) as e:
            _ = [m async for m in c.generate(bad)]
    assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT and len(r1.calls) == 1


async def test_a_moment_when_no_router_can_serve_is_waited_out_within_the_deadline(
    routers: list[tuple[StandinRouter, str]],
) -> None:
    """Both routers answer UNAVAILABLE for 0.4 s (a worker restarting in each zone): the client backs off
    between rounds over every router instead of spending its attempts in a burst, and the request succeeds
    well within its deadline, with few attempts in the outage."""
    (r1, a1), (r2, a2) = routers
    r1.down_until = r2.down_until = time.monotonic() + 0.4
    async with AsyncClient(routers=[a1, a2], max_attempts=12, timeout_s=10) as c:
        msgs = [m async for m in c.generate(req(5))]
    assert [t for m in msgs for t in m.token_ids] == EXPECTED[:5]
    # a burst spends all 12 in milliseconds and fails; pauses of 0.05 s doubling (jittered to at least half)
    # cover 0.4 s within 5 rounds of 2 attempts
    assert 3 <= c.attempts_total <= 11


async def test_the_backoff_never_outlasts_the_deadline(routers: list[tuple[StandinRouter, str]]) -> None:
    (r1, a1), (r2, a2) = routers
    r1.down_until = r2.down_until = time.monotonic() + 60
    t0 = time.monotonic()
    async with AsyncClient(routers=[a1, a2], max_attempts=1000, timeout_s=0.5, retry_backoff_s=0.2) as c:
        with pytest.raises(DeadlineExceeded):
            _ = [m async for m in c.generate(req(5))]
    assert time.monotonic() - t0 < 2.0
