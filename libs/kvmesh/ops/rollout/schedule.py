"""The rollout state machine (pure, `now` passed in): steps, hold time, rollback, standby.

    start(new, old, plan, now)           → RUNNING at steps[0] (5 %): weights {new: 0.05, old: 0.95}
    step(r, verdict, now) → (r', action) one check of the canary:
        RUNNING, verdict failed          → ROLLED_BACK, Action.ROLLBACK (the weights before the rollout)
        RUNNING, passed, held ≥ hold_s   → next step (Action.SET_WEIGHTS); the last one (100 %) is PROMOTED
        RUNNING, passed, held < hold_s   → unchanged (Action.NONE): the step is held
        PROMOTED, now ≥ standby_until    → COMPLETE, Action.STANDBY_EXPIRED: the old version may be retired
    abort(r, reason, now)                a RUNNING rollout whose controller failed → ROLLED_BACK (fail safe)
    where held = now − the step's start and standby_until = promotion time + standby_s (48 h by default).

So a version failing a check never carries more than the share of the step it is on: a check runs every
check interval while a step is held, and the next step needs a passing check after the hold.
"""

from __future__ import annotations

import enum
import itertools
import math
from collections.abc import Sequence
from dataclasses import dataclass, replace

from kvmesh.core.errors import InvalidArgument
from kvmesh.discovery.traffic import UPGRADE_STEPS_PCT, canary_step
from kvmesh.ops.rollout.canary import Verdict

DEFAULT_STANDBY_S = 48 * 3600.0


class Phase(enum.Enum):
    RUNNING = "running"
    PROMOTED = "promoted"  # at 100 %, the old version on standby
    COMPLETE = "complete"  # standby over
    ROLLED_BACK = "rolled_back"


class Action(enum.Enum):
    NONE = "none"
    SET_WEIGHTS = "set_weights"
    ROLLBACK = "rollback"
    STANDBY_EXPIRED = "standby_expired"


@dataclass(frozen=True)
class RolloutPlan:
    steps_pct: tuple[float, ...] = UPGRADE_STEPS_PCT
    hold_s: float = 300.0
    standby_s: float = DEFAULT_STANDBY_S

    def validated(self) -> RolloutPlan:
        s = self.steps_pct
        if not s or any(not (0 < p <= 100) or not math.isfinite(p) for p in s):
            raise InvalidArgument("rollout_steps", f"every step must be in (0, 100], got {s}")
        if any(b <= a for a, b in itertools.pairwise(s)) or s[-1] != 100:
            raise InvalidArgument("rollout_steps", f"steps must increase and end at 100, got {s}")
        if len(s) < 2:
            raise InvalidArgument("rollout_steps", f"a canary needs a step below 100 before 100, got {s}")
        for name in ("hold_s", "standby_s"):
            v = getattr(self, name)
            if not math.isfinite(v) or v < 0:
                raise InvalidArgument(f"rollout_{name}", f"must be a finite number >= 0, got {v}")
        return self


@dataclass(frozen=True)
class Event:
    at: float
    kind: str  # started, step, held, check_failed, rolled_back, promoted, standby_expired
    message: str


@dataclass(frozen=True)
class Rollout:
    new_version: str
    old_version: str
    plan: RolloutPlan
    phase: Phase
    step_index: int
    step_since: float
    events: tuple[Event, ...] = ()
    verdict: Verdict | None = None
    standby_until: float = 0.0
    max_new_share: float = 0.0

    @property
    def new_share(self) -> float:
        """The new version's share of traffic now (0 after a rollback)."""
        if self.phase is Phase.ROLLED_BACK:
            return 0.0
        return self.plan.steps_pct[self.step_index] / 100.0

    def weights(self) -> dict[str, float]:
        return canary_step(self.old_version, self.new_version, self.plan.steps_pct[self.step_index])

    def _event(self, now: float, kind: str, message: str) -> tuple[Event, ...]:
        return (*self.events, Event(now, kind, message))


def start(new_version: str, old_version: str, plan: RolloutPlan, now: float) -> Rollout:
    """A rollout at its first step (InvalidArgument naming the field for empty or equal versions)."""
    for name, v in (("new_version", new_version), ("old_version", old_version)):
        if not v:
            raise InvalidArgument(name, "must be non-empty")
    if new_version == old_version:
        raise InvalidArgument("new_version", f"must differ from old_version ({old_version!r})")
    plan = plan.validated()
    first = plan.steps_pct[0]
    ev = Event(now, "started", f"{new_version} replaces {old_version}: step 1/{len(plan.steps_pct)} at {first:g} %")
    return Rollout(new_version, old_version, plan, Phase.RUNNING, 0, now, (ev,), max_new_share=first / 100.0)


def step(r: Rollout, verdict: Verdict | None, now: float) -> tuple[Rollout, Action]:
    """One check (module docstring); `verdict` None when no measurement was made (nothing changes)."""
    if r.phase is Phase.PROMOTED and now >= r.standby_until:
        msg = f"standby of {r.old_version} over: it may be retired"
        return replace(r, phase=Phase.COMPLETE, events=r._event(now, "standby_expired", msg)), Action.STANDBY_EXPIRED
    if r.phase is not Phase.RUNNING or verdict is None:
        return r, Action.NONE
    pct = r.plan.steps_pct[r.step_index]
    if not verdict.passed:
        msg = f"{r.new_version} at {pct:g} % failed {', '.join(verdict.failed)}: {'; '.join(verdict.reasons)}"
        done = replace(r, phase=Phase.ROLLED_BACK, verdict=verdict, events=r._event(now, "rolled_back", msg))
        return done, Action.ROLLBACK
    if now - r.step_since < r.plan.hold_s:
        return replace(r, verdict=verdict), Action.NONE
    nxt = r.step_index + 1
    share = r.plan.steps_pct[nxt] / 100.0
    last = nxt == len(r.plan.steps_pct) - 1
    if last:
        until = now + r.plan.standby_s
        msg = f"{r.new_version} promoted to 100 %; {r.old_version} on standby for {r.plan.standby_s:g} s"
        phase, kind = Phase.PROMOTED, "promoted"
    else:
        until, phase, kind = 0.0, Phase.RUNNING, "step"
        msg = f"{r.new_version} passed at {pct:g} %: step {nxt + 1}/{len(r.plan.steps_pct)} at {100 * share:g} %"
    out = replace(
        r,
        phase=phase,
        step_index=nxt,
        step_since=now,
        verdict=verdict,
        standby_until=until,
        max_new_share=max(r.max_new_share, share),
        events=r._event(now, kind, msg),
    )
    return out, Action.SET_WEIGHTS


def abort(r: Rollout, reason: str, now: float) -> Rollout:
    """A running rollout ended without a verdict (the controller failed): ROLLED_BACK, failing safe."""
    if r.phase is not Phase.RUNNING:
        return r
    msg = f"{r.new_version} at {r.plan.steps_pct[r.step_index]:g} % aborted: {reason}"
    return replace(r, phase=Phase.ROLLED_BACK, events=r._event(now, "rolled_back", msg))


def parse_steps(text: str) -> tuple[float, ...]:
    """'5,10,50,100' → (5.0, 10.0, 50.0, 100.0) (InvalidArgument naming rollout_steps)."""
    try:
        steps: Sequence[float] = tuple(float(x) for x in text.split(",") if x.strip())
    except ValueError as e:
        raise InvalidArgument("rollout_steps", f"not a comma list of numbers: {text!r}") from e
    return RolloutPlan(tuple(steps)).validated().steps_pct
