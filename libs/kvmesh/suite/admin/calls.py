"""The admin RPCs the CLI makes, each on a channel of `kvmesh.rpc.channel.open_channel`, each reply turned into
its `kvmesh.suite.admin.views` document; a failed call becomes an `AdminError` that names the method, the
address and what to do (`explain`)."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable, Sequence
from typing import Any, TypeVar

import grpc

from kvmesh.rpc.channel import open_channel
from kvmesh.suite.admin import views
from kvmesh.suite.admin.target import (
    EXIT_DENIED,
    EXIT_FAILED,
    EXIT_UNREACHABLE,
    AdminError,
    Target,
    operator_token_file,
)
from kvmesh.v1 import (
    cache_manager_pb2,
    cache_manager_pb2_grpc,
    failover_pb2,
    failover_pb2_grpc,
    planner_pb2,
    planner_pb2_grpc,
    router_pb2,
    router_pb2_grpc,
)

T = TypeVar("T")


def explain(err: grpc.RpcError, target: Target, method: str) -> AdminError:
    """One line for a failed call: a denial names the role it needs, an unreachable service its address."""
    code = err.code() if callable(getattr(err, "code", None)) else grpc.StatusCode.UNKNOWN  # type: ignore[attr-defined]
    details = (err.details() if callable(getattr(err, "details", None)) else "") or ""  # type: ignore[attr-defined]
    where = f"{method} on the {target.service} at {target.address}"
    if code is grpc.StatusCode.PERMISSION_DENIED:
        return AdminError(f"{where}: PERMISSION_DENIED, needs role admin ({details})", EXIT_DENIED)
    if code is grpc.StatusCode.UNAUTHENTICATED:
        own = operator_token_file()
        suite = f" (the local suite's: --token-file {own})" if own else ""
        hint = f"give an admin credential: --token-file FILE or --token TOKEN{suite}, or with TLS --ca/--cert/--key"
        return AdminError(f"{where}: UNAUTHENTICATED, needs role admin; {hint} ({details})", EXIT_DENIED)
    if code in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED):
        tls = "TLS" if target.security.tls_ca else "plaintext"
        return AdminError(
            f"cannot reach the {target.service} at {target.address} ({target.source}, {tls}): {code.name}: {details}",
            EXIT_UNREACHABLE,
        )
    return AdminError(f"{where}: {code.name}: {details}", EXIT_FAILED)


async def _call(target: Target, method: str, timeout: float, run: Callable[[Any], Awaitable[T]]) -> T:
    """`run(channel)` on a channel to `target`, its RpcError explained."""
    try:
        async with open_channel(target.address, target.security) as channel:
            return await run(channel)
    except grpc.RpcError as err:
        raise explain(err, target, method) from None


async def list_workers(t: Target, timeout: float) -> dict[str, Any]:
    """The router's workers (each one's prefill/decode role in its endpoint's `worker_role` meta)."""

    async def run(ch: Any) -> router_pb2.ListWorkersResponse:
        return await router_pb2_grpc.RouterAdminServiceStub(ch).ListWorkers(
            router_pb2.ListWorkersRequest(), timeout=timeout
        )

    return views.workers(await _call(t, "RouterAdminService/ListWorkers", timeout, run), t.address)


async def rebalance(t: Target, timeout: float, prefill: float, decode: float) -> dict[str, Any]:
    async def run(ch: Any) -> router_pb2.RebalanceResponse:
        req = router_pb2.RebalanceRequest(prefill_weight=prefill, decode_weight=decode)
        return await router_pb2_grpc.RouterAdminServiceStub(ch).Rebalance(req, timeout=timeout)

    r = await _call(t, "RouterAdminService/Rebalance", timeout, run)
    return {"router": t.address, "prefill_weight": r.prefill_weight, "decode_weight": r.decode_weight}


async def drain(t: Target, timeout: float, worker_id: str, on: bool, force: bool = False) -> dict[str, Any]:
    async def run(ch: Any) -> router_pb2.DrainWorkerResponse:
        req = router_pb2.DrainWorkerRequest(worker_id=worker_id, drain=on, force=force)
        return await router_pb2_grpc.RouterAdminServiceStub(ch).DrainWorker(req, timeout=timeout)

    r = await _call(t, "RouterAdminService/DrainWorker", timeout, run)
    return {"router": t.address, "worker_id": worker_id, "draining": on, "in_flight": r.in_flight}


async def _router_workers(t: Target, timeout: float) -> dict[str, Any]:
    """One router's workers, or its error (a zone's rotation is then unknown, the view goes on)."""
    try:
        return await list_workers(t, timeout)
    except AdminError as exc:
        return {"router": t.address, "error": str(exc)}


async def zones(t: Target, timeout: float, routers: Sequence[Target] = ()) -> dict[str, Any]:
    """Zone health and weights from the failover service, and from `routers` (each zone's) the workers each
    zone has in rotation: a zone the failover service counts healthy can still have none (all drained)."""

    async def run(ch: Any) -> tuple[failover_pb2.GetZoneHealthResponse, failover_pb2.GetTrafficWeightsResponse]:
        stub = failover_pb2_grpc.FailoverServiceStub(ch)
        health = await stub.GetZoneHealth(failover_pb2.GetZoneHealthRequest(), timeout=timeout)
        weights = await stub.GetTrafficWeights(failover_pb2.GetTrafficWeightsRequest(), timeout=timeout)
        return health, weights

    (health, weights), *seen = await asyncio.gather(
        _call(t, "FailoverService/GetZoneHealth", timeout, run), *(_router_workers(r, timeout) for r in routers)
    )
    return views.zones(health, weights.weights, t.address, views.rotation(seen))


async def weights(
    t: Target, timeout: float, zone_weights: dict[str, float], version_weights: dict[str, float], rollback: bool
) -> dict[str, Any]:
    """Sets the given weights, or rolls back the last change, or (neither) reads the weights in force."""
    stub_of = failover_pb2_grpc.FailoverServiceStub
    if rollback:
        method = "FailoverService/RollbackTrafficWeights"

        async def run(ch: Any) -> failover_pb2.TrafficWeights:
            req = failover_pb2.RollbackTrafficWeightsRequest()
            return (await stub_of(ch).RollbackTrafficWeights(req, timeout=timeout)).weights

        action = "rollback"
    elif zone_weights or version_weights:
        method = "FailoverService/SetTrafficWeights"

        async def run(ch: Any) -> failover_pb2.TrafficWeights:
            w = failover_pb2.TrafficWeights(zone_weights=zone_weights, version_weights=version_weights)
            req = failover_pb2.SetTrafficWeightsRequest(weights=w)
            return (await stub_of(ch).SetTrafficWeights(req, timeout=timeout)).weights

        action = "set"
    else:
        method = "FailoverService/GetTrafficWeights"

        async def run(ch: Any) -> failover_pb2.TrafficWeights:
            req = failover_pb2.GetTrafficWeightsRequest()
            return (await stub_of(ch).GetTrafficWeights(req, timeout=timeout)).weights

        action = "get"
    w = await _call(t, method, timeout, run)
    return {"failover": t.address, "action": action, **views.traffic_weights(w)}


async def index(t: Target, timeout: float, top: int = 0) -> dict[str, Any]:
    """Statistics with the `top` most-queried prefixes, and the warming policy (a SetWarmingPolicy whose
    policy has every field 0 changes nothing and reads it)."""

    async def run(ch: Any) -> tuple[cache_manager_pb2.GetStatsResponse, cache_manager_pb2.WarmingPolicy]:
        stub = cache_manager_pb2_grpc.CacheManagerServiceStub(ch)
        stats = await stub.GetStats(cache_manager_pb2.GetStatsRequest(top_prefixes=top), timeout=timeout)
        policy = await stub.SetWarmingPolicy(
            cache_manager_pb2.SetWarmingPolicyRequest(policy=cache_manager_pb2.WarmingPolicy()), timeout=timeout
        )
        return stats, policy.policy

    stats, policy = await _call(t, "CacheManagerService/GetStats", timeout, run)
    return views.index(stats, policy, t.address)


async def rollout(t: Target, timeout: float, new_version: str = "", old_version: str = "") -> dict[str, Any]:
    """Starts a rollout of ``new_version`` replacing ``old_version`` (both given), or reads the current one."""
    stub_of = failover_pb2_grpc.FailoverServiceStub
    if new_version:
        method = "FailoverService/StartRollout"

        async def run(ch: Any) -> failover_pb2.Rollout | None:
            req = failover_pb2.StartRolloutRequest(new_version=new_version, old_version=old_version)
            return (await stub_of(ch).StartRollout(req, timeout=timeout)).rollout

    else:
        method = "FailoverService/GetRollout"

        async def run(ch: Any) -> failover_pb2.Rollout | None:
            reply = await stub_of(ch).GetRollout(failover_pb2.GetRolloutRequest(), timeout=timeout)
            return reply.rollout if reply.HasField("rollout") else None

    return views.rollout(await _call(t, method, timeout, run), t.address)


async def warming(t: Target, timeout: float, policy: cache_manager_pb2.WarmingPolicy) -> dict[str, Any]:
    """Sets the warming policy's fields that are not 0 (all 0: reads it); the policy in force after."""

    async def run(ch: Any) -> cache_manager_pb2.SetWarmingPolicyResponse:
        req = cache_manager_pb2.SetWarmingPolicyRequest(policy=policy)
        return await cache_manager_pb2_grpc.CacheManagerServiceStub(ch).SetWarmingPolicy(req, timeout=timeout)

    r = await _call(t, "CacheManagerService/SetWarmingPolicy", timeout, run)
    changed = bool(policy.ListFields())
    return {"cache_manager": t.address, "action": "set" if changed else "get", **views.warming_policy(r.policy)}


async def planner(t: Target, timeout: float) -> dict[str, Any]:
    async def run(ch: Any) -> planner_pb2.GetPlanResponse:
        return await planner_pb2_grpc.PlannerServiceStub(ch).GetPlan(planner_pb2.GetPlanRequest(), timeout=timeout)

    return views.plan(await _call(t, "PlannerService/GetPlan", timeout, run), t.address)


async def guardrails(t: Target, timeout: float, reload: bool) -> dict[str, Any]:
    """The router's guardrail rules in force, after reading the rule files now when `reload`."""
    stub_of = router_pb2_grpc.RouterAdminServiceStub
    if reload:
        method = "RouterAdminService/ReloadGuardrails"

        async def run(ch: Any) -> tuple[router_pb2.GuardrailsState, bool | None]:
            r = await stub_of(ch).ReloadGuardrails(router_pb2.ReloadGuardrailsRequest(), timeout=timeout)
            return r.guardrails, r.changed

    else:
        method = "RouterAdminService/GetGuardrails"

        async def run(ch: Any) -> tuple[router_pb2.GuardrailsState, bool | None]:
            r = await stub_of(ch).GetGuardrails(router_pb2.GetGuardrailsRequest(), timeout=timeout)
            return r.guardrails, None

    state, changed = await _call(t, method, timeout, run)
    return {"router": t.address, **views.guardrails(state), **({} if changed is None else {"changed": changed})}
