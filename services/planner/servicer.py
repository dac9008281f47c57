"""`PlannerService/GetPlan`: every zone's forecast, worker counts and recent decisions, from the planning loop's
state (`kvmesh planner` shows it; role admin)."""

from __future__ import annotations

from collections.abc import Mapping

import grpc

from kvmesh.core.handoff import WorkerRole
from kvmesh.ops.planner.pools import PoolPlan
from kvmesh.rpc.audit import audited
from kvmesh.security.admin import no_unknown_fields
from kvmesh.services.planner.loop import PlannerLoop, Step
from kvmesh.v1 import planner_pb2, planner_pb2_grpc, worker_pb2

SERVICE = "planner"  # as the audit log names it


def step_pb(st: Step) -> planner_pb2.PlannerDecision:
    """A step as GetPlan returns it."""
    d = st.decision
    return planner_pb2.PlannerDecision(
        at=st.at,
        desired=d.desired,
        serving=st.serving,
        starting=st.starting,
        queued=st.queued,
        forecast_rps=d.forecast_rps,
        add=d.action.add,
        remove=list(d.action.remove),
        reason=d.action.reason,
        pools=pools_pb(d.pools, st.worker_ids) if d.pools is not None else None,
    )


def _role_pb(role: WorkerRole) -> worker_pb2.WorkerRole.ValueType:
    return worker_pb2.WorkerRole.Value(f"WORKER_ROLE_{role.value.upper()}")


def pools_pb(p: PoolPlan, ids: Mapping[str, str]) -> planner_pb2.PoolSplit:
    t = p.targets
    return planner_pb2.PoolSplit(
        desired_prefill=t.prefill,
        desired_decode=t.decode,
        prefill=p.prefill,
        decode=p.decode,
        forecast_prefill_tokens_per_s=t.prefill_tokens_per_s,
        forecast_decode_streams=t.decode_streams,
        role_changes=[
            planner_pb2.RoleChange(
                worker_id=ids.get(c.worker_id, ""),
                address=c.worker_id,  # the planner knows serving workers by address
                from_role=_role_pb(c.from_role),
                to_role=_role_pb(c.to_role),
            )
            for c in p.changes
        ],
        reason=p.reason,
    )


class PlannerServicer(planner_pb2_grpc.PlannerServiceServicer):
    """Reads the loop's state; changes nothing."""

    def __init__(self, loop: PlannerLoop, actuator: str, interval_s: float) -> None:
        self.loop = loop
        self.actuator = actuator
        self.interval_s = interval_s

    async def GetPlan(  # type: ignore[override]
        self, request: planner_pb2.GetPlanRequest, context: grpc.aio.ServicerContext
    ) -> planner_pb2.GetPlanResponse:
        with audited(SERVICE, "PlannerService/GetPlan"):
            no_unknown_fields(request)
            zones = []
            for zone, rt in sorted(self.loop.zones.items()):
                p = rt.planner
                cmp = p.comparison
                mae = {"lstm": cmp.lstm_mae, **cmp.baselines} if cmp is not None else {}
                last = rt.last
                zones.append(
                    planner_pb2.ZonePlan(
                        zone=zone,
                        forecaster=last.decision.forecaster if last is not None else p.forecaster().name,
                        forecast_mae=mae,
                        bucket_s=p.config.bucket_s,
                        history_buckets=len(p.history.counts),
                        forecast=list(last.decision.forecast) if last is not None else [],
                        last=step_pb(last) if last is not None else None,
                        decisions=[step_pb(s) for s in rt.steps],
                        error=rt.error,
                    )
                )
            return planner_pb2.GetPlanResponse(actuator=self.actuator, interval_s=self.interval_s, zones=zones)
