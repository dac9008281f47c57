"""Prefill/decode pools: how many prefill and decode workers a disaggregated zone needs for its forecast, and
which workers change role when the split should move (pure).

As Dynamo's planner sizes them, each pool against its own latency target (a prefill worker's throughput is
bounded by the TTFT target, a decode worker's concurrency by the ITL target), from the rate the zone is sized
for (``rps``, :meth:`SizingPolicy.sized_rate`: the forecast's peak over ``lead_s``):

    prefill tokens/s = rps · prompt_tokens_per_request
    decode streams   = rps · output_tokens_per_request · itl_s           (Little's law: arrivals × stream life)
    prefill          = max(ceil(prefill tokens/s · (1 + buffer) / prefill_tokens_per_s), min_prefill)
    decode           = max(ceil(decode streams · (1 + buffer) / decode_streams), min_decode)

``prefill_tokens_per_s`` is one prefill worker's prompt tokens per second with the TTFT target kept,
``decode_streams`` one decode worker's concurrent streams with the ITL target (``itl_s``) kept: measure both
(``python -m kvmesh.bench fleet``), as ``per_worker_rps``. The zone's total follows the sizing policy's bounds:
below ``min_workers`` the decode pool takes the rest, above ``max_workers`` both pools shrink in proportion
(never below their minimum).

The split moves by role changes, not by starting and stopping: when one pool is short of its target while the
other holds more than its own, ``min(short, surplus, role_change_step)`` workers of the larger pool are
drained and restarted as the other role (youngest first: the warmest caches stay), once the same shortfall
has stood for ``split_delay_s`` (a forecast that moves back and forth changes no role) and at most one step
per ``split_delay_s``. Workers of role ``both`` (aggregated) count toward the decode pool (they decode) and
never change role. What both pools lack or hold beyond the change is the zone's scale-out and scale-in
(:func:`kvmesh.ops.planner.sizing.plan_step`).
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from kvmesh.core.handoff import WorkerRole
from kvmesh.ops.planner.sizing import WorkerLife


@dataclass(frozen=True)
class PoolPolicy:
    """The two pools' capacity model (the module docstring's symbols) and role-change rules."""

    prompt_tokens_per_request: float = 1024.0
    output_tokens_per_request: float = 256.0
    prefill_tokens_per_s: float = 7000.0  # ≈ 1 / PdParams.prefill_s_per_token: the router's prefill cost
    decode_streams: float = 64.0
    itl_s: float = 0.1  # the fleet simulator's SLO (kvmesh.fleet.metrics.Slo.itl_s)
    buffer: float = 0.2
    min_prefill: int = 1
    min_decode: int = 1
    split_delay_s: float = 600.0
    role_change_step: int = 1

    def __post_init__(self) -> None:
        """A bad value is a ValueError whose message starts with the field's name."""
        for name in ("prefill_tokens_per_s", "decode_streams", "itl_s"):
            if not getattr(self, name) > 0:
                raise ValueError(f"{name} must be > 0, got {getattr(self, name)}")
        for name in ("prompt_tokens_per_request", "output_tokens_per_request", "buffer", "split_delay_s"):
            if not getattr(self, name) >= 0:
                raise ValueError(f"{name} must be >= 0, got {getattr(self, name)}")
        for name, least in (("min_prefill", 0), ("min_decode", 1), ("role_change_step", 1)):
            if getattr(self, name) < least:
                raise ValueError(f"{name} must be >= {least}, got {getattr(self, name)}")


@dataclass(frozen=True)
class PoolTargets:
    """The workers each pool needs, and the forecast figures they were sized from."""

    prefill: int
    decode: int
    prefill_tokens_per_s: float  # forecast prompt tokens per second to prefill
    decode_streams: float  # forecast concurrent decode streams

    @property
    def total(self) -> int:
        return self.prefill + self.decode


def pool_targets(policy: PoolPolicy, rps: float, min_workers: int = 1, max_workers: int = 1 << 30) -> PoolTargets:
    """Each pool's workers for the sized rate ``rps`` (requests/s), the zone's total within
    [``min_workers``, ``max_workers``] (the module docstring's formula)."""
    rps = max(rps, 0.0)
    tokens = rps * policy.prompt_tokens_per_request
    streams = rps * policy.output_tokens_per_request * policy.itl_s
    grow = 1.0 + policy.buffer
    prefill = max(math.ceil(tokens * grow / policy.prefill_tokens_per_s - 1e-9), policy.min_prefill)
    decode = max(math.ceil(streams * grow / policy.decode_streams - 1e-9), policy.min_decode)
    if prefill + decode < min_workers:
        decode = min_workers - prefill
    elif prefill + decode > max_workers:
        room = max(max_workers, policy.min_prefill + policy.min_decode)
        scaled = max(round(room * prefill / (prefill + decode)), policy.min_prefill)
        prefill = min(scaled, room - policy.min_decode)
        decode = room - prefill
    return PoolTargets(prefill, decode, tokens, streams)


@dataclass(frozen=True)
class PooledWorker:
    """A serving worker of the zone and its role (``both`` where the router does not list one)."""

    life: WorkerLife
    role: WorkerRole


@dataclass(frozen=True)
class RoleChange:
    """Drain ``worker_id`` and restart it as ``to_role``."""

    worker_id: str
    from_role: WorkerRole
    to_role: WorkerRole


@dataclass
class SplitState:
    """What :func:`plan_split` remembers between steps: since when the pools have been short the same way."""

    short: WorkerRole | None = None
    since_s: float = 0.0
    last_change_s: float = -math.inf


@dataclass(frozen=True)
class PoolPlan:
    """A step's pool sizing: the targets, the pools (serving, and changing into them), the role changes, and
    why (or why not)."""

    targets: PoolTargets
    prefill: int
    decode: int
    changes: tuple[RoleChange, ...] = ()
    reason: str = ""


def plan_split(
    policy: PoolPolicy,
    state: SplitState,
    now_s: float,
    targets: PoolTargets,
    serving: Sequence[PooledWorker],
    incoming: Mapping[WorkerRole, int] | None = None,
) -> PoolPlan:
    """The role changes that move the pools toward ``targets`` (the module docstring's rule); updates ``state``.
    ``incoming``: workers already changing into each pool (they count there)."""
    pools = {r: [w for w in serving if w.role is r] for r in WorkerRole}
    more = incoming or {}
    prefill = len(pools[WorkerRole.PREFILL]) + more.get(WorkerRole.PREFILL, 0)
    decode = len(pools[WorkerRole.DECODE]) + len(pools[WorkerRole.BOTH]) + more.get(WorkerRole.DECODE, 0)
    short_p, short_d = targets.prefill - prefill, targets.decode - decode
    if short_p > 0 and short_d < 0:
        short, n, donors = WorkerRole.PREFILL, min(short_p, -short_d), pools[WorkerRole.DECODE]
    elif short_d > 0 and short_p < 0:
        short, n, donors = WorkerRole.DECODE, min(short_d, -short_p), pools[WorkerRole.PREFILL]
    else:
        state.short = None
        return PoolPlan(targets, prefill, decode)
    if state.short is not short:
        state.short, state.since_s = short, now_s
    want = f"{short.value} pool short by {n} (needs {targets.prefill}P/{targets.decode}D, has {prefill}P/{decode}D)"
    if now_s - state.since_s < policy.split_delay_s:
        return PoolPlan(targets, prefill, decode, reason=f"{want}: role change delay")
    if now_s - state.last_change_s < policy.split_delay_s:
        return PoolPlan(targets, prefill, decode, reason=f"{want}: role change cooldown")
    donors = sorted(donors, key=lambda w: (-w.life.started_s, w.life.worker_id))  # youngest first
    moved = donors[: min(n, policy.role_change_step)]
    if not moved:  # the surplus is of role both, which keeps its role
        return PoolPlan(targets, prefill, decode, reason=f"{want}: no worker of the other role to change")
    state.last_change_s = now_s
    changes = tuple(RoleChange(w.life.worker_id, w.role, short) for w in moved)
    return PoolPlan(targets, prefill, decode, changes, want)
