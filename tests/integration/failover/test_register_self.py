"""The failover service's per-role rules (the security review: "anyone can register a router"), over real gRPC on
loopback.

A router may register or deregister only itself (its identity's id, as a router); an admin may do either for
anyone; with no authentication (no identity) it is as before. Admin calls carry no unknown fields, and each
lands in the audit log (``kvmesh.audit``: who, what, result). The servicer runs in-process over a real static
registry file behind `tests.support.identity` (the stand-in for the authorisation core's identity).
"""

from __future__ import annotations

import json
import logging
from collections.abc import AsyncIterator
from pathlib import Path

import grpc
import pytest

from kvmesh.discovery.static import StaticRegistry
from kvmesh.discovery.watcher import DiscoveryWatcher
from kvmesh.rpc.audit import AUDIT_LOGGER
from kvmesh.security.identity import CallerRole, Identity
from kvmesh.services.failover.__main__ import make_policy
from kvmesh.services.failover.endpoint_sets import EndpointSetPublisher
from kvmesh.services.failover.servicer import FailoverServicer
from kvmesh.services.failover.settings import FailoverSettings
from kvmesh.v1 import common_pb2, failover_pb2, failover_pb2_grpc
from tests.support.identity import metadata_of, serve

pytestmark = pytest.mark.integration
R1 = Identity(CallerRole.ROUTER, "router-a-1")
ADMIN = Identity(CallerRole.ADMIN, "ops")


def endpoint(ident: str, role: int = common_pb2.SERVICE_ROLE_ROUTER, port: int = 50051) -> common_pb2.Endpoint:
    return common_pb2.Endpoint(id=ident, role=role, address=f"127.0.0.1:{port}", zone="a", version="v1")


@pytest.fixture
async def failover(tmp_path: Path) -> AsyncIterator[tuple[failover_pb2_grpc.FailoverServiceStub, StaticRegistry]]:
    import asyncio

    registry = StaticRegistry(tmp_path / "registry.yaml")
    publisher = EndpointSetPublisher(DiscoveryWatcher(registry), make_policy(FailoverSettings()))
    servicer = FailoverServicer(publisher, registry, asyncio.Event())
    server, address = await serve(failover_pb2_grpc.add_FailoverServiceServicer_to_server, servicer, "failover")
    async with grpc.aio.insecure_channel(address) as ch:
        stub = failover_pb2_grpc.FailoverServiceStub(ch)
        stub.channel = ch  # type: ignore[attr-defined]  # for raw calls
        yield stub, registry
    await server.stop(None)


async def ids(registry: StaticRegistry) -> set[str]:
    return {i.id for i in (await registry.snapshot())[1].instances}


def audit_lines(caplog: pytest.LogCaptureFixture) -> list[dict[str, object]]:
    return [json.loads(r.getMessage()) for r in caplog.records if r.name == AUDIT_LOGGER]


async def test_a_router_registers_only_itself(
    failover: tuple[failover_pb2_grpc.FailoverServiceStub, StaticRegistry], caplog: pytest.LogCaptureFixture
) -> None:
    stub, registry = failover
    caplog.set_level(logging.INFO, logger=AUDIT_LOGGER)
    await stub.Register(failover_pb2.RegisterRequest(endpoint=endpoint(R1.id)), metadata=metadata_of(R1))
    await stub.Register(
        failover_pb2.RegisterRequest(endpoint=endpoint("router-b-1", port=50052)), metadata=metadata_of(ADMIN)
    )
    assert await ids(registry) == {R1.id, "router-b-1"}

    refused = [
        failover_pb2.RegisterRequest(endpoint=endpoint("router-evil", port=6666)),  # another id
        failover_pb2.RegisterRequest(endpoint=endpoint("router-b-1", port=6666)),  # an existing router's id
        failover_pb2.RegisterRequest(endpoint=endpoint(R1.id, common_pb2.SERVICE_ROLE_WORKER)),  # itself as a worker
    ]
    for req in refused:
        with pytest.raises(grpc.aio.AioRpcError) as ei:
            await stub.Register(req, metadata=metadata_of(R1))
        assert ei.value.code() == grpc.StatusCode.PERMISSION_DENIED
        assert "router:router-a-1" in (ei.value.details() or "")
    with pytest.raises(grpc.aio.AioRpcError) as ei:
        await stub.Deregister(failover_pb2.DeregisterRequest(id="router-b-1"), metadata=metadata_of(R1))
    assert ei.value.code() == grpc.StatusCode.PERMISSION_DENIED

    snap = (await registry.snapshot())[1].by_id()
    assert set(snap) == {R1.id, "router-b-1"} and snap["router-b-1"].port == 50052

    assert (await stub.Deregister(failover_pb2.DeregisterRequest(id=R1.id), metadata=metadata_of(R1))).removed
    assert await ids(registry) == {"router-b-1"}

    lines = audit_lines(caplog)
    got = [(a["who"], a["action"], dict(a["args"]).get("id"), a["result"]) for a in lines]  # type: ignore[call-overload]
    assert got == [
        ("router:router-a-1", "FailoverService/Register", R1.id, "ok"),
        ("admin:ops", "FailoverService/Register", "router-b-1", "ok"),
        ("router:router-a-1", "FailoverService/Register", "router-evil", "PERMISSION_DENIED"),
        ("router:router-a-1", "FailoverService/Register", "router-b-1", "PERMISSION_DENIED"),
        ("router:router-a-1", "FailoverService/Register", R1.id, "PERMISSION_DENIED"),
        ("router:router-a-1", "FailoverService/Deregister", "router-b-1", "PERMISSION_DENIED"),
        ("router:router-a-1", "FailoverService/Deregister", R1.id, "ok"),
    ]
    assert all(str(a["when"]).endswith("+00:00") for a in lines)


async def test_admin_rpcs_refuse_unknown_fields_and_audit_the_refusal(
    failover: tuple[failover_pb2_grpc.FailoverServiceStub, StaticRegistry], caplog: pytest.LogCaptureFixture
) -> None:
    stub, _registry = failover
    caplog.set_level(logging.INFO, logger=AUDIT_LOGGER)
    ch = stub.channel  # type: ignore[attr-defined]
    raw = ch.unary_unary(
        "/kvmesh.v1.FailoverService/SetTrafficWeights",
        request_serializer=lambda b: b,
        response_deserializer=failover_pb2.SetTrafficWeightsResponse.FromString,
    )
    weights = failover_pb2.SetTrafficWeightsRequest(
        weights=failover_pb2.TrafficWeights(version_weights={"v1": 1.0})
    ).SerializeToString()
    with pytest.raises(grpc.aio.AioRpcError) as ei:
        await raw(weights + b"\x98\x06\x01", metadata=metadata_of(ADMIN))  # + field 99 = 1
    assert ei.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "99" in (ei.value.details() or "")
    with pytest.raises(grpc.aio.AioRpcError) as ei:
        await stub.Register(failover_pb2.RegisterRequest(endpoint=endpoint(R1.id), check_interval_s=float("nan")))
    assert ei.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    got = [(a["who"], a["action"], a["result"]) for a in audit_lines(caplog)]
    assert got == [
        ("admin:ops", "FailoverService/SetTrafficWeights", "INVALID_ARGUMENT"),
        ("anonymous", "FailoverService/Register", "INVALID_ARGUMENT"),
    ]
