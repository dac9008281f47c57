"""Side studies of the report, on synthetic workloads (deterministic under the seed).

* :func:`concurrent_long_study` — ``clients`` (32) closed-loop clients sending long prompts over shared
  documents (``synthetic.concurrent_long``) to a fleet of ``workers``; compares policies on per-worker
  utilisation variance and end-to-end P99 (the gap DESIGN.md §1 describes).
* :func:`warming_study` — many tenants with long shared system prompts (``synthetic.shared_prefix_tenants``)
  under the kvmesh policy with warming none / static / dynamic (``fleet.warming``).
"""

from __future__ import annotations

from collections.abc import Sequence
from concurrent.futures import ProcessPoolExecutor
from dataclasses import replace
from typing import Any

from kvmesh.fleet.evaluate import result_payload
from kvmesh.fleet.policies import make_policy
from kvmesh.fleet.sim import FleetConfig, FleetSim
from kvmesh.fleet.synthetic import concurrent_long, shared_prefix_tenants
from kvmesh.fleet.trace import CHUNK_TOKENS
from kvmesh.fleet.warming import DynamicWarming, StaticWarming, tenant_templates

TENANT_KW: dict[str, Any] = {"n_tenants": 48, "sys_tokens": 8192, "rate": 8.0, "duration_s": 600.0}


def _concurrent(args: tuple[str, FleetConfig, int, str | None]) -> dict[str, Any]:
    policy, cfg, clients, profile = args
    tr = concurrent_long(seed=cfg.seed, clients=clients)
    res = FleetSim(tr, make_policy(policy, profile), cfg).run()
    return {"policy": policy, **result_payload(res, keep_records=False)}


def concurrent_long_study(
    policies: Sequence[str],
    base: FleetConfig,
    workers: int = 8,
    clients: int = 32,
    n_proc: int = 1,
    kvmesh_profile: str | None = None,
) -> dict[str, Any]:
    cfg = replace(base, workers=workers, load_scale=1.0, stop_when_slo_lost=False)
    args = [(p, cfg, clients, kvmesh_profile) for p in policies]
    if n_proc > 1:
        with ProcessPoolExecutor(n_proc) as ex:
            outs = list(ex.map(_concurrent, args))
    else:
        outs = [_concurrent(a) for a in args]
    return {"workers": workers, "clients": clients, "runs": {o["policy"]: o for o in outs}}


def _warming(args: tuple[str, FleetConfig, str | None]) -> dict[str, Any]:
    mode, cfg, profile = args
    tr = shared_prefix_tenants(seed=cfg.seed, **TENANT_KW)
    warmer: StaticWarming | DynamicWarming | None = None
    if mode == "static":
        warmer = StaticWarming(tenant_templates(tr, TENANT_KW["sys_tokens"] // CHUNK_TOKENS, 0.3, 2))
    elif mode == "dynamic":
        warmer = DynamicWarming()
    res = FleetSim(tr, make_policy("kvmesh", profile), cfg, warmer=warmer).run()
    return {"mode": mode, **result_payload(res, keep_records=False)}


def warming_study(base: FleetConfig, n_proc: int = 1, kvmesh_profile: str | None = None) -> dict[str, Any]:
    cfg = replace(base, load_scale=1.0, stop_when_slo_lost=False)
    args = [(m, cfg, kvmesh_profile) for m in ("none", "static", "dynamic")]
    if n_proc > 1:
        with ProcessPoolExecutor(n_proc) as ex:
            outs = list(ex.map(_warming, args))
    else:
        outs = [_warming(a) for a in args]
    return {"workload": dict(TENANT_KW), "runs": {o["mode"]: o for o in outs}}
