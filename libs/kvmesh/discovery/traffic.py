"""Traffic weights between zones and between versions (pure).

Weights are non-negative finite numbers with a positive total; they are stored normalised, so
``share(k) = w_k / sum_j w_j``. A version with weight 0 that is still registered is on *standby*:
it gets no traffic while a weighted version serves, and takes over only if none does.

Upgrade path: ``canary_step(old, new, pct)`` gives ``{new: pct/100, old: 1 - pct/100}`` for the
steps 5 → 10 → 50 → 100 %; at 100 % the old version stays registered on standby (weight 0).
A `TrafficPlan` keeps a bounded history, so ``rollback()`` restores the previous weights in one call.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass

from kvmesh.core.errors import FailedPrecondition, InvalidArgument

UPGRADE_STEPS_PCT: tuple[float, ...] = (5.0, 10.0, 50.0, 100.0)
HISTORY_LIMIT = 32


def normalise_weights(field: str, weights: Mapping[str, float]) -> dict[str, float]:
    """Validate and normalise: every ``w >= 0`` and finite, ``sum(w) > 0``; returns ``w / sum(w)``.

    Raises ``InvalidArgument(field, ...)`` for an empty map, a negative / non-finite weight or a
    non-positive total.
    """
    if not weights:
        raise InvalidArgument(field, "must name at least one entry")
    for key, w in weights.items():
        if not key:
            raise InvalidArgument(field, "keys must be non-empty")
        if not isinstance(w, int | float) or not math.isfinite(w):
            raise InvalidArgument(f"{field}[{key}]", f"must be a finite number, got {w!r}")
        if w < 0:
            raise InvalidArgument(f"{field}[{key}]", f"must be >= 0, got {w}")
    total = float(sum(weights.values()))
    if not total > 0:
        raise InvalidArgument(field, f"weights must sum to a positive total, got {total}")
    return {k: float(w) / total for k, w in sorted(weights.items())}


def canary_step(old_version: str, new_version: str, pct: float) -> dict[str, float]:
    """Weights for one upgrade step: ``new = pct/100``, ``old = 1 - pct/100`` (old stays on standby at 100)."""
    if old_version == new_version:
        raise InvalidArgument("new_version", "must differ from old_version")
    if not (0 < pct <= 100) or not math.isfinite(pct):
        raise InvalidArgument("pct", f"must be in (0, 100], got {pct}")
    return {new_version: pct / 100.0, old_version: 1.0 - pct / 100.0}


def next_upgrade_pct(current_new_share: float) -> float:
    """The next step of 5 → 10 → 50 → 100 after the current share of the new version (0..1)."""
    for step in UPGRADE_STEPS_PCT:
        if step / 100.0 > current_new_share + 1e-9:
            return step
    return 100.0


@dataclass(frozen=True)
class TrafficPlan:
    """Current normalised weights plus the history of previous ones (most recent last).

    ``generation`` increases by one on every change, rollbacks included.
    """

    weights: Mapping[str, float]
    history: tuple[Mapping[str, float], ...] = ()
    generation: int = 0

    @staticmethod
    def initial(field: str, weights: Mapping[str, float]) -> TrafficPlan:
        return TrafficPlan(normalise_weights(field, weights), (), 0)

    def set(self, field: str, weights: Mapping[str, float]) -> TrafficPlan:
        new = normalise_weights(field, weights)
        hist = (*self.history, dict(self.weights))[-HISTORY_LIMIT:]
        return TrafficPlan(new, hist, self.generation + 1)

    def rollback(self) -> TrafficPlan:
        """Restore the weights in force before the last `set` (FailedPrecondition when none)."""
        if not self.history:
            raise FailedPrecondition("no previous traffic weights to roll back to")
        return TrafficPlan(dict(self.history[-1]), self.history[:-1], self.generation + 1)


def version_shares(weights: Mapping[str, float], present: set[str]) -> dict[str, float]:
    """Shares among the versions `present` (having an up endpoint).

    ``share(v) = w_v / sum_{u in present} w_u`` over present versions with ``w > 0``. If none of
    them is weighted, traffic goes to the present standby versions equally (versions unknown to the
    plan count as standby); with nothing present the result is empty.
    """
    weighted = {v: weights.get(v, 0.0) for v in present if weights.get(v, 0.0) > 0}
    total = sum(weighted.values())
    if total > 0:
        return {v: w / total for v, w in sorted(weighted.items())}
    if not present:
        return {}
    return {v: 1.0 / len(present) for v in sorted(present)}
