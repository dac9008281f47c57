"""Failover servicer: proto <-> domain over kvmesh.discovery (logic lives in endpoint_sets.py)."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Mapping

import grpc

from kvmesh.core.errors import FailedPrecondition, InvalidArgument, NotFound, PermissionDenied
from kvmesh.discovery.model import Health, Role, ServiceInstance
from kvmesh.discovery.registry import CheckSpec, Registry
from kvmesh.discovery.traffic import normalise_weights
from kvmesh.discovery.zones import zone_reason
from kvmesh.ops.rollout.schedule import Phase, Rollout
from kvmesh.rpc.audit import audited
from kvmesh.rpc.validate import in_range, non_empty
from kvmesh.security.admin import no_unknown_fields
from kvmesh.security.identity import CallerRole, current_identity
from kvmesh.services.failover.endpoint_sets import EndpointSetPublisher
from kvmesh.services.failover.rollout import RolloutController
from kvmesh.v1 import common_pb2, failover_pb2, failover_pb2_grpc

ROLE_TO_PB = {
    Role.ROUTER: common_pb2.SERVICE_ROLE_ROUTER,
    Role.WORKER: common_pb2.SERVICE_ROLE_WORKER,
    Role.CACHE_MANAGER: common_pb2.SERVICE_ROLE_CACHE_MANAGER,
    Role.FAILOVER: common_pb2.SERVICE_ROLE_FAILOVER,
}
PB_TO_ROLE = {v: k for k, v in ROLE_TO_PB.items()}
HEALTH_TO_PB = {
    Health.PASSING: common_pb2.HEALTH_STATE_PASSING,
    Health.WARNING: common_pb2.HEALTH_STATE_WARNING,
    Health.CRITICAL: common_pb2.HEALTH_STATE_CRITICAL,
}
PHASE_TO_PB = {
    Phase.RUNNING: failover_pb2.ROLLOUT_PHASE_RUNNING,
    Phase.PROMOTED: failover_pb2.ROLLOUT_PHASE_PROMOTED,
    Phase.COMPLETE: failover_pb2.ROLLOUT_PHASE_COMPLETE,
    Phase.ROLLED_BACK: failover_pb2.ROLLOUT_PHASE_ROLLED_BACK,
}


def rollout_pb(r: Rollout) -> failover_pb2.Rollout:
    v = r.verdict
    return failover_pb2.Rollout(
        new_version=r.new_version,
        old_version=r.old_version,
        phase=PHASE_TO_PB[r.phase],
        new_share=r.new_share,
        max_new_share=r.max_new_share,
        events=[failover_pb2.RolloutEvent(at=e.at, kind=e.kind, message=e.message) for e in r.events],
        standby_until=r.standby_until,
        failed_checks=list(v.failed) if v else [],
        consistency=v.consistency if v else 0.0,
        latency_regression=v.latency_regression if v else 0.0,
        memory_diff=v.memory_diff if v else 0.0,
    )


SERVICE = "failover"  # as the audit log names it
SELF_ROLES = {  # callers that may (de)register only themselves, as their own role
    CallerRole.ROUTER: Role.ROUTER,
    CallerRole.WORKER: Role.WORKER,
    CallerRole.CACHE_MANAGER: Role.CACHE_MANAGER,
    CallerRole.FAILOVER: Role.FAILOVER,
}


def check_self(instance_id: str, role: Role | None, field: str) -> None:
    """A service caller (when authenticated) registers or deregisters only itself: its identity's id is the
    instance id and its role the instance's role. Admins and unauthenticated services (no auth) are free; other
    roles are refused by the authorisation table before this."""
    caller = current_identity()
    if caller is None or caller.role not in SELF_ROLES:
        return
    own = SELF_ROLES[caller.role]
    if instance_id != caller.id or (role is not None and role is not own):
        what = f"{role.value} {instance_id!r}" if role is not None else repr(instance_id)
        raise PermissionDenied(f"{field}: caller {caller} may register or deregister only itself, not {what}")


def known_names(field: str, what: str, weights: Mapping[str, float], known: set[str]) -> None:
    """Weights name real zones (versions) only: a typo would otherwise take every real one out of traffic
    (a zone the weights do not name gets none). InvalidArgument names the first unknown one and the known ones."""
    for name in sorted(weights):
        if name not in known:
            listed = ", ".join(sorted(known)) or "none"
            raise InvalidArgument(f"{field}[{name}]", f"unknown {what} {name!r} (known: {listed})")


def endpoint_pb(i: ServiceInstance) -> common_pb2.Endpoint:
    return common_pb2.Endpoint(
        id=i.id,
        role=ROLE_TO_PB[i.role],
        address=i.target,
        zone=i.zone,
        version=i.version,
        health=HEALTH_TO_PB[i.health],
        meta=dict(i.meta),
    )


def instance_from_pb(e: common_pb2.Endpoint) -> ServiceInstance:
    if e.role not in PB_TO_ROLE:
        raise InvalidArgument("endpoint.role", "must be set")
    host, sep, port = e.address.rpartition(":")
    if not sep or not port.isdigit():
        raise InvalidArgument("endpoint.address", f"expected host:port, got {e.address!r}")
    meta = dict(e.meta)
    try:
        capacity = float(meta.pop("capacity", "1"))
    except ValueError as exc:
        raise InvalidArgument("endpoint.meta[capacity]", "not a number") from exc
    return ServiceInstance(
        e.id, PB_TO_ROLE[e.role], e.zone, e.version or "v1", host, int(port), capacity=capacity, meta=meta
    )


class FailoverServicer(failover_pb2_grpc.FailoverServiceServicer):
    """Discovery, zone health and traffic weights."""

    def __init__(
        self,
        publisher: EndpointSetPublisher,
        registry: Registry | None,
        stopping: asyncio.Event,
        rollouts: RolloutController | None = None,
    ) -> None:
        self.publisher = publisher
        self.registry = registry
        self.stopping = stopping
        self.rollouts = rollouts

    def endpoints_response(self, roles: set[Role]) -> failover_pb2.WatchEndpointsResponse:
        d = self.publisher.decision
        zones = []
        for z, v in sorted(d.views.items()):
            items = [
                i for i in (*v.routers, *v.cache_managers, *v.workers, *v.failovers) if not roles or i.role in roles
            ]
            zones.append(
                failover_pb2.ZoneEndpoints(
                    zone=z,
                    healthy=d.states[z].healthy,
                    weight=d.zone_weights.get(z, 0.0),
                    endpoints=[endpoint_pb(i) for i in items],
                )
            )
        return failover_pb2.WatchEndpointsResponse(
            zones=zones,
            version_weights=self.publisher.version_weights(),
            revision=self.publisher.revision,
            stale=self.publisher.stale,
        )

    async def WatchEndpoints(  # type: ignore[override]
        self, request: failover_pb2.WatchEndpointsRequest, context: grpc.aio.ServicerContext
    ) -> AsyncIterator[failover_pb2.WatchEndpointsResponse]:
        roles = {PB_TO_ROLE[r] for r in request.roles if r in PB_TO_ROLE}
        sent = -1
        while not self.stopping.is_set():
            rev = await self.publisher.wait_revision(sent, 0.5)
            if rev != sent:
                sent = rev
                yield self.endpoints_response(roles)

    def _registry(self) -> Registry:
        if self.registry is None:
            raise FailedPrecondition("no registry configured (set --registry-file or --consul-url)")
        return self.registry

    async def Register(  # type: ignore[override]
        self, request: failover_pb2.RegisterRequest, context: grpc.aio.ServicerContext
    ) -> failover_pb2.RegisterResponse:
        e = request.endpoint
        with audited(
            SERVICE,
            "FailoverService/Register",
            id=e.id,
            role=PB_TO_ROLE.get(e.role, e.role),
            address=e.address,
            zone=e.zone,
        ):
            no_unknown_fields(request)
            inst = instance_from_pb(e)
            check_self(inst.id, inst.role, "endpoint.id")
            in_range(request.check_interval_s, "check_interval_s", 0.0, 3600.0)
            interval = request.check_interval_s or 1.0
            await self._registry().register(inst, CheckSpec(interval_s=interval, timeout_s=interval))
            return failover_pb2.RegisterResponse()

    async def Deregister(  # type: ignore[override]
        self, request: failover_pb2.DeregisterRequest, context: grpc.aio.ServicerContext
    ) -> failover_pb2.DeregisterResponse:
        with audited(SERVICE, "FailoverService/Deregister", id=request.id) as a:
            no_unknown_fields(request)
            non_empty(request.id, "id")
            check_self(request.id, None, "id")
            try:
                await self._registry().deregister(request.id)
            except NotFound:
                a["removed"] = False
                return failover_pb2.DeregisterResponse(removed=False)
            a["removed"] = True
            return failover_pb2.DeregisterResponse(removed=True)

    def known_zones(self) -> set[str]:
        """The zones this service decides for: its configured ones and every zone an instance registered in."""
        return set(self.publisher.decision.views)

    def known_versions(self) -> set[str]:
        """The versions registered instances run."""
        return {i.version for i in self.publisher.watcher.snapshot.instances}

    def _weights(self) -> failover_pb2.TrafficWeights:
        return failover_pb2.TrafficWeights(
            zone_weights=dict(self.publisher.policy.zone_plan.weights),
            version_weights=dict(self.publisher.policy.version_plan.weights),
        )

    async def SetTrafficWeights(  # type: ignore[override]
        self, request: failover_pb2.SetTrafficWeightsRequest, context: grpc.aio.ServicerContext
    ) -> failover_pb2.SetTrafficWeightsResponse:
        zw, vw = dict(request.weights.zone_weights), dict(request.weights.version_weights)
        with audited(SERVICE, "FailoverService/SetTrafficWeights", zone_weights=zw, version_weights=vw):
            no_unknown_fields(request)
            if not zw and not vw:
                raise InvalidArgument("weights", "set zone_weights and/or version_weights")
            # Validate at the API boundary so errors name the request's field path.
            if zw:
                normalise_weights("weights.zone_weights", zw)
                known_names("weights.zone_weights", "zone", zw, self.known_zones())
            if vw:
                normalise_weights("weights.version_weights", vw)
                known_names("weights.version_weights", "version", vw, self.known_versions())
            await self.publisher.set_weights(zw, vw)
            return failover_pb2.SetTrafficWeightsResponse(weights=self._weights())

    async def GetTrafficWeights(  # type: ignore[override]
        self, request: failover_pb2.GetTrafficWeightsRequest, context: grpc.aio.ServicerContext
    ) -> failover_pb2.GetTrafficWeightsResponse:
        return failover_pb2.GetTrafficWeightsResponse(weights=self._weights())

    async def RollbackTrafficWeights(  # type: ignore[override]
        self, request: failover_pb2.RollbackTrafficWeightsRequest, context: grpc.aio.ServicerContext
    ) -> failover_pb2.RollbackTrafficWeightsResponse:
        with audited(SERVICE, "FailoverService/RollbackTrafficWeights"):
            no_unknown_fields(request)
            await self.publisher.rollback()
            return failover_pb2.RollbackTrafficWeightsResponse(weights=self._weights())

    async def GetZoneHealth(  # type: ignore[override]
        self, request: failover_pb2.GetZoneHealthRequest, context: grpc.aio.ServicerContext
    ) -> failover_pb2.GetZoneHealthResponse:
        d = self.publisher.decision
        zones = [
            failover_pb2.ZoneHealth(
                zone=z,
                healthy=d.states[z].healthy,
                reason=zone_reason(d.states[z], v),
                routers=len(v.routers),
                cache_managers=len(v.cache_managers),
                workers=len(v.workers),
                since=d.states[z].since,
                rewarm_hold=d.states[z].rewarm_hold,
                rewarm_pending_from=list(v.rewarm_from),
                starting=d.states[z].starting,
            )
            for z, v in sorted(d.views.items())
        ]
        return failover_pb2.GetZoneHealthResponse(
            zones=zones, registry_reachable=self.publisher.watcher.reachable is True
        )

    def _rollouts(self) -> RolloutController:
        if self.rollouts is None:
            raise FailedPrecondition("this failover service runs no rollout controller")
        return self.rollouts

    async def StartRollout(  # type: ignore[override]
        self, request: failover_pb2.StartRolloutRequest, context: grpc.aio.ServicerContext
    ) -> failover_pb2.StartRolloutResponse:
        new, old = request.new_version, request.old_version
        with audited(SERVICE, "FailoverService/StartRollout", new_version=new, old_version=old):
            no_unknown_fields(request)
            non_empty(new, "new_version")
            non_empty(old, "old_version")
            r = await self._rollouts().start(new, old)
            return failover_pb2.StartRolloutResponse(rollout=rollout_pb(r))

    async def GetRollout(  # type: ignore[override]
        self, request: failover_pb2.GetRolloutRequest, context: grpc.aio.ServicerContext
    ) -> failover_pb2.GetRolloutResponse:
        r = self._rollouts().current
        return failover_pb2.GetRolloutResponse(rollout=rollout_pb(r) if r is not None else None)
