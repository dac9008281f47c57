"""Warming decisions (pure): static templates at start, dynamic warming of hot prefixes at run time.

Dynamic: a prefix p with `rate(p) ≥ threshold` observations in the window (default 5 per 60 s) gets

    target(p) = min(max_replicas, 1 + ⌊rate(p) / threshold⌋)

workers holding it. Missing replicas go to the workers that do not hold p, least loaded first (ties by
worker id), skipping workers with load ≥ `max_load`. A prefix is only warmed if the hybrid LFU+LRU warm
set admits it (`HybridWarmSet`, size = n_blocks · target, initial score = rate); prefixes the warm set
evicts are reported as `cooled` (they are no longer re-warmed). At most `max_actions` per round.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field

from kvmesh.ops.warming.policy import HybridWarmSet
from kvmesh.ops.warming.stats import PrefixInfo, PrefixStats
from kvmesh.ops.warming.templates import Template


@dataclass(frozen=True, slots=True)
class WarmingConfig:
    """Knobs of the warming decisions."""

    threshold: int = 5
    window_s: float = 60.0
    max_replicas: int = 4
    max_load: float = 0.9
    max_actions: int = 16


@dataclass(frozen=True, slots=True)
class WarmAction:
    """Prefill `token_ids` (prefill only, no decode) on `worker`."""

    worker: str
    key: int
    token_ids: tuple[int, ...]
    reason: str
    tenant: str | None = None


@dataclass(slots=True)
class WarmPlan:
    """Actions of one decision round, and prefixes the warm set dropped."""

    actions: list[WarmAction] = field(default_factory=list)
    cooled: list[int] = field(default_factory=list)
    rejected: list[int] = field(default_factory=list)


def pick_workers(holders: set[str], loads: Mapping[str, float], want: int, max_load: float) -> list[str]:
    """`want` workers not in `holders`, least loaded first, below `max_load`."""
    cands = sorted((ld, w) for w, ld in loads.items() if w not in holders and ld < max_load)
    return [w for _ld, w in cands[: max(want, 0)]]


def target_replicas(rate: int, cfg: WarmingConfig) -> int:
    """min(max_replicas, 1 + ⌊rate / threshold⌋)."""
    return min(cfg.max_replicas, 1 + rate // cfg.threshold)


def plan_dynamic(
    stats: PrefixStats,
    now: float,
    loads: Mapping[str, float],
    holders: Callable[[int, PrefixInfo], set[str]],
    warm: HybridWarmSet,
    cfg: WarmingConfig,
) -> WarmPlan:
    """One dynamic warming round (see module docstring)."""
    plan = WarmPlan()
    for key, inf in stats.hot(now, cfg.threshold):
        if len(plan.actions) >= cfg.max_actions:
            break
        if inf.token_ids is None:
            continue
        target = target_replicas(inf.count, cfg)
        ok, evicted = warm.admit(key, inf.n_blocks * target, now, hits=float(inf.count))
        plan.cooled += evicted
        if not ok:
            plan.rejected.append(key)
            continue
        have = holders(key, inf)
        room = cfg.max_actions - len(plan.actions)
        for w in pick_workers(have, loads, min(target - len(have), room), cfg.max_load):
            plan.actions.append(WarmAction(w, key, inf.token_ids, "dynamic", inf.tenant))
    return plan


def plan_static(
    templates: Sequence[Template],
    loads: Mapping[str, float],
    holders: Callable[[Template], set[str]],
    warm: HybridWarmSet | None = None,
    key_of: Callable[[Template], int] | None = None,
    block_size: int = 1,
    max_load: float = 1.0,
) -> WarmPlan:
    """Cold-start preload: each template onto `replicas` workers (0 = all), least loaded first; pinned."""
    plan = WarmPlan()
    for i, t in enumerate(templates):
        key = key_of(t) if key_of is not None else i
        have = holders(t)
        want = (len(loads) if t.replicas == 0 else t.replicas) - len(have)
        if warm is not None:
            warm.admit(key, max(1, len(t.token_ids) // block_size), 0.0, hits=1.0, pinned=True)
        for w in pick_workers(have, loads, want, max_load):
            plan.actions.append(WarmAction(w, key, t.token_ids, "static"))
    return plan
