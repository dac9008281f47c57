"""A worker aborts a request only for the caller that started it (the security review: "Abort another client's request
by id, the victim sees a normal finish"), over real gRPC on loopback.

The worker servicer runs with a real sim engine in-process behind `tests.support.identity` (the stand-in for
the authorisation core, which sets the same `identity_var`): router A streams a request; router B's Abort of
that id is PERMISSION_DENIED and A's stream goes on producing tokens; B cannot take the id over by starting
its own Generate with it; A's own Abort works.
"""

from __future__ import annotations

from collections.abc import AsyncIterator

import grpc
import pytest

from kvmesh.security.identity import CallerRole, Identity
from kvmesh.services.worker.app import WorkerApp
from kvmesh.services.worker.engine_factory import build_engine
from kvmesh.services.worker.servicer import WorkerServicer
from kvmesh.services.worker.settings import WorkerSettings
from kvmesh.v1 import common_pb2, worker_pb2, worker_pb2_grpc
from tests.support.identity import metadata_of, serve

pytestmark = pytest.mark.integration
A = Identity(CallerRole.ROUTER, "router-a")
B = Identity(CallerRole.ROUTER, "router-b")


def gen(rid: str, max_tokens: int) -> worker_pb2.GenerateRequest:
    return worker_pb2.GenerateRequest(
        request_id=rid,
        token_ids=common_pb2.TokenIds(ids=list(range(3, 67))),
        sampling=common_pb2.SamplingParams(max_tokens=max_tokens, ignore_eos=True),
    )


@pytest.fixture
async def worker() -> AsyncIterator[worker_pb2_grpc.WorkerServiceStub]:
    settings = WorkerSettings(engine="sim", block_size=32, kv_blocks=256, sim_speed=1.0)
    engine = build_engine(settings)
    await engine.start()
    app = WorkerApp(engine, "sim", "worker-t")
    server, address = await serve(
        worker_pb2_grpc.add_WorkerServiceServicer_to_server, WorkerServicer(app, settings), "worker"
    )
    async with grpc.aio.insecure_channel(address) as ch:
        yield worker_pb2_grpc.WorkerServiceStub(ch)
    await server.stop(None)
    await engine.stop()


async def test_abort_only_by_the_starter(worker: worker_pb2_grpc.WorkerServiceStub) -> None:
    victim = worker.Generate(gen("victim-1", 4000), metadata=metadata_of(A), timeout=60)
    first = await victim.read()
    assert first.token_ids and not first.finish_reason

    with pytest.raises(grpc.aio.AioRpcError) as ei:
        await worker.Abort(worker_pb2.AbortRequest(request_id="victim-1"), metadata=metadata_of(B), timeout=10)
    assert ei.value.code() == grpc.StatusCode.PERMISSION_DENIED
    assert "router:router-b" in (ei.value.details() or "")
    client = Identity(CallerRole.CLIENT, "mallory")
    with pytest.raises(grpc.aio.AioRpcError) as ei:
        await worker.Abort(worker_pb2.AbortRequest(request_id="victim-1"), metadata=metadata_of(client), timeout=10)
    assert ei.value.code() == grpc.StatusCode.PERMISSION_DENIED

    # taking the id over by starting a request under it is refused too
    thief = worker.Generate(gen("victim-1", 4), metadata=metadata_of(B), timeout=10)
    with pytest.raises(grpc.aio.AioRpcError) as ei:
        await thief.read()
    assert ei.value.code() == grpc.StatusCode.PERMISSION_DENIED

    # the victim's request runs on: more tokens, no abort
    after = await victim.read()
    assert after.token_ids and not after.finish_reason

    # an id nobody of that caller started: nothing to abort (the same answer as for an unknown id)
    got = await worker.Abort(worker_pb2.AbortRequest(request_id="nope"), metadata=metadata_of(B), timeout=10)
    assert not got.aborted

    got = await worker.Abort(worker_pb2.AbortRequest(request_id="victim-1"), metadata=metadata_of(A), timeout=10)
    assert got.aborted
    last = await victim.read()
    while not last.finish_reason:
        last = await victim.read()
    assert last.finish_reason == common_pb2.FINISH_REASON_ABORT
