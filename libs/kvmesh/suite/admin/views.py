"""The admin CLI's data: replies of the admin RPCs as plain JSON-able dicts (the `--json` documents' parts).

One function per reply, pure (no I/O): every field the operator reads, with its proto name, enum values as
lower-case words (``passing``, ``half_open``), so that the text views (`kvmesh.suite.admin.render`) and the
JSON output show the same thing.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from kvmesh.discovery.model import WORKER_ROLE_META
from kvmesh.v1 import cache_manager_pb2, common_pb2, failover_pb2, planner_pb2, router_pb2, worker_pb2


def _health(value: common_pb2.HealthState.ValueType) -> str:
    return common_pb2.HealthState.Name(value).removeprefix("HEALTH_STATE_").lower()


def worker(st: router_pb2.WorkerStatus) -> dict[str, Any]:
    """One worker as a router sees it; `state` is ``draining`` while drained, else its health. `role`: its
    prefill/decode role (both, prefill, decode), its endpoint's `worker_role` meta ("" from a router that does
    not say)."""
    load = st.load
    return {
        "id": st.endpoint.id,
        "address": st.endpoint.address,
        "zone": st.endpoint.zone,
        "role": st.endpoint.meta.get(WORKER_ROLE_META, ""),
        "version": st.endpoint.version,
        "health": _health(st.endpoint.health),
        "state": "draining" if st.draining else _health(st.endpoint.health),
        "circuit": st.circuit,
        "draining": st.draining,
        "in_flight": st.in_flight,
        "selections_total": st.selections_total,
        "running": load.running,
        "waiting": load.waiting,
        "max_queue": load.max_queue,
        "kv_usage": load.kv_usage,
        "kv_blocks_used": load.kv_blocks_used,
        "kv_blocks_total": load.kv_blocks_total,
        "prefill_tokens_queued": load.prefill_tokens_queued,
        "decode_tokens_active": load.decode_tokens_active,
        "decode_latency_p95_ms": load.decode_latency_p95_ms,
        "prefix_hit_rate": load.prefix_hit_rate,
        "error_rate": load.error_rate,
    }


def workers(reply: router_pb2.ListWorkersResponse, router: str) -> dict[str, Any]:
    """The router's workers."""
    return {
        "router": router,
        "prefill_weight": reply.prefill_weight,
        "decode_weight": reply.decode_weight,
        "workers": [worker(w) for w in reply.workers],
    }


def traffic_weights(w: failover_pb2.TrafficWeights) -> dict[str, dict[str, float]]:
    return {
        "zone_weights": dict(sorted(w.zone_weights.items())),
        "version_weights": dict(sorted(w.version_weights.items())),
    }


def routable(w: Mapping[str, Any]) -> bool:
    """A worker (`worker`'s document) in rotation: passing, not draining, circuit not open (the router's rule)."""
    return w["state"] == "passing" and w["circuit"] != "open"


def rotation(seen: Sequence[Mapping[str, Any]]) -> dict[str, dict[str, int]]:
    """Per zone, from routers' `workers` documents (a failed one holds `error` and counts nothing): its workers in
    rotation (`routable`), draining and in all, as the router that sees most of them in rotation says."""
    out: dict[str, dict[str, int]] = {}
    for doc in seen:
        per: dict[str, dict[str, int]] = {}
        for w in doc.get("workers", []):
            z = per.setdefault(w["zone"], {"routable": 0, "draining": 0, "workers": 0})
            z["routable"] += routable(w)
            z["draining"] += w["draining"]
            z["workers"] += 1
        for zone, counts in per.items():
            if zone not in out or counts["routable"] > out[zone]["routable"]:
                out[zone] = counts
    return out


def zones(
    health: failover_pb2.GetZoneHealthResponse,
    weights: failover_pb2.TrafficWeights,
    failover: str,
    in_rotation: Mapping[str, Mapping[str, int]] | None = None,
) -> dict[str, Any]:
    """Zone health joined with the zone weights in force (`weight` None for a zone the weights do not name) and,
    from the zones' routers (`rotation`), the workers each has in rotation (`routable` None where no router
    said)."""
    zw = dict(weights.zone_weights)
    seen = in_rotation or {}
    return {
        "failover": failover,
        "registry_reachable": health.registry_reachable,
        "zones": [
            {
                "zone": z.zone,
                "healthy": z.healthy,
                "starting": z.starting,
                "reason": z.reason,
                "weight": zw.get(z.zone),
                "routers": z.routers,
                "cache_managers": z.cache_managers,
                "workers": z.workers,
                "routable": seen[z.zone]["routable"] if z.zone in seen else None,
                "draining": seen[z.zone]["draining"] if z.zone in seen else None,
                "since": z.since,
                "rewarm_hold": z.rewarm_hold,
                "rewarm_pending_from": list(z.rewarm_pending_from),
            }
            for z in health.zones
        ],
        **traffic_weights(weights),
    }


def warming_policy(p: cache_manager_pb2.WarmingPolicy) -> dict[str, Any]:
    return {
        "hot_threshold": p.hot_threshold,
        "window_s": p.window_s,
        "max_replicas": p.max_replicas,
        "capacity": p.capacity,
        "lfu_weight": p.lfu_weight,
    }


def index(
    stats: cache_manager_pb2.GetStatsResponse, policy: cache_manager_pb2.WarmingPolicy, cache_manager: str
) -> dict[str, Any]:
    """The cache-manager's statistics, its most-queried prefixes (as many as asked for), its warming policy and
    the zones whose indexes it follows."""
    return {
        "cache_manager": cache_manager,
        "workers": stats.workers,
        "blocks": stats.blocks,
        "pairs": stats.pairs,
        "batches_total": stats.batches_total,
        "gaps_total": stats.gaps_total,
        "resyncs_total": stats.resyncs_total,
        "hit_ratio": stats.hit_ratio,
        "warming_actions_total": stats.warming_actions_total,
        "block_size": stats.block_size,
        "model": stats.model,
        "warming_policy": warming_policy(policy),
        "top_prefixes": [
            {
                "key": f"{p.key:016x}",
                "blocks": p.blocks,
                "tokens": p.blocks * stats.block_size,
                "window_count": p.window_count,
                "total": p.total,
                "last_seen": p.last_seen,
                "tenant": p.tenant,
            }
            for p in stats.top_prefixes
        ],
        "zone": stats.zone,
        "replication": [
            {
                "zone": r.zone,
                "prefixes": r.prefixes,
                "blocks": r.blocks,
                "bytes_total": r.bytes_total,
                "failures_total": r.failures_total,
                "budget_bytes_per_s": r.budget_bytes_per_s,
                "pending": r.pending,
            }
            for r in stats.replication
        ],
        "followed_zones": [
            {
                "zone": z.zone,
                "address": z.address,
                "connected": z.connected,
                "revision": z.revision,
                "lag_s": z.lag_s,
                "blocks": z.blocks,
                "snapshots": z.snapshots,
                "resumes": z.resumes,
            }
            for z in stats.followed_zones
        ],
    }


def rollout(reply: failover_pb2.Rollout | None, failover: str) -> dict[str, Any]:
    """The current or last rollout (``rollout`` None when none was ever started); phase as a lower-case word."""
    if reply is None:
        return {"failover": failover, "rollout": None}
    return {
        "failover": failover,
        "rollout": {
            "new_version": reply.new_version,
            "old_version": reply.old_version,
            "phase": failover_pb2.RolloutPhase.Name(reply.phase).removeprefix("ROLLOUT_PHASE_").lower(),
            "new_share": reply.new_share,
            "max_new_share": reply.max_new_share,
            "standby_until": reply.standby_until,
            "failed_checks": list(reply.failed_checks),
            "consistency": reply.consistency,
            "latency_regression": reply.latency_regression,
            "memory_diff": reply.memory_diff,
            "events": [{"at": e.at, "kind": e.kind, "message": e.message} for e in reply.events],
        },
    }


def guardrails(g: router_pb2.GuardrailsState) -> dict[str, Any]:
    return {"enabled": g.enabled, "path": g.path, "rules": g.rules, "version": g.version, "loaded_at": g.loaded_at}


def _decision(d: planner_pb2.PlannerDecision) -> dict[str, Any]:
    return {
        "at": d.at,
        "desired": d.desired,
        "serving": d.serving,
        "starting": d.starting,
        "queued": d.queued,
        "forecast_rps": d.forecast_rps,
        "add": d.add,
        "remove": list(d.remove),
        "reason": d.reason,
        "pools": _pools(d.pools) if d.HasField("pools") else None,
    }


def worker_role(value: worker_pb2.WorkerRole.ValueType) -> str:
    """A worker's prefill/decode role as the word its `--role` takes; unset (an older worker) is both."""
    return worker_pb2.WorkerRole.Name(value or worker_pb2.WORKER_ROLE_BOTH).removeprefix("WORKER_ROLE_").lower()


def _pools(p: planner_pb2.PoolSplit) -> dict[str, Any]:
    """A disaggregated zone's pools: targets, serving, the forecast figures, the role changes."""
    return {
        "desired_prefill": p.desired_prefill,
        "desired_decode": p.desired_decode,
        "prefill": p.prefill,
        "decode": p.decode,
        "forecast_prefill_tokens_per_s": p.forecast_prefill_tokens_per_s,
        "forecast_decode_streams": p.forecast_decode_streams,
        "role_changes": [
            {
                "worker_id": c.worker_id,
                "address": c.address,
                "from": worker_role(c.from_role),
                "to": worker_role(c.to_role),
            }
            for c in p.role_changes
        ],
        "reason": p.reason,
    }


def plan(reply: planner_pb2.GetPlanResponse, planner: str) -> dict[str, Any]:
    """The planner's zones: forecaster, forecast, the last decision (None before the first step), recent ones."""
    return {
        "planner": planner,
        "actuator": reply.actuator,
        "interval_s": reply.interval_s,
        "zones": [
            {
                "zone": z.zone,
                "forecaster": z.forecaster,
                "forecast_mae": dict(sorted(z.forecast_mae.items())),
                "bucket_s": z.bucket_s,
                "history_buckets": z.history_buckets,
                "forecast": list(z.forecast),
                "last": _decision(z.last) if z.HasField("last") else None,
                "decisions": [_decision(d) for d in z.decisions],
                "error": z.error,
            }
            for z in reply.zones
        ],
    }
