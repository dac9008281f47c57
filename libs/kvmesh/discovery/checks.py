"""Health of static-registry instances from active probes (pure: results are passed in, no I/O, no clock).

A static registry runs no checks of its own, so `kvmesh.discovery.probing` probes each instance and feeds
every result here. An instance turns *critical* after `failures` consecutive failed probes and *passing*
again after `successes` consecutive good ones; an instance never probed yet is passing (what its file
entry says). The health served is the worst of the file's and the probes' (`Health.worst`): an operator
can still mark an instance critical in the file.

Detection bound for a dead process (a refused connection fails a probe at once):
``failures * interval_s``, plus one interval of phase; a hung one adds up to ``timeout_s`` per probe.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, replace

from kvmesh.core.errors import InvalidArgument
from kvmesh.discovery.model import CatalogSnapshot, Health


@dataclass(frozen=True)
class ProbePolicy:
    """Tunables of static-registry probing (see the module docstring)."""

    interval_s: float = 0.5
    timeout_s: float = 0.5
    failures: int = 3
    successes: int = 2

    def __post_init__(self) -> None:
        for name in ("interval_s", "timeout_s"):
            v = getattr(self, name)
            if not (math.isfinite(v) and v > 0):
                raise InvalidArgument(name, "must be a finite number > 0")
        for name in ("failures", "successes"):
            if getattr(self, name) < 1:
                raise InvalidArgument(name, "must be >= 1")


@dataclass(frozen=True)
class ProbeState:
    """What the probes say about one instance; `streak` counts consecutive results disagreeing with it."""

    health: Health = Health.PASSING
    streak: int = 0


def step_probe(state: ProbeState, ok: bool, policy: ProbePolicy) -> ProbeState:
    """Advances one instance's probe state by one probe result."""
    agrees = ok == (state.health is Health.PASSING)
    if agrees:
        return ProbeState(state.health, 0)
    streak = state.streak + 1
    if streak >= (policy.successes if ok else policy.failures):
        return ProbeState(Health.PASSING if ok else Health.CRITICAL, 0)
    return ProbeState(state.health, streak)


def probed_snapshot(snapshot: CatalogSnapshot, states: Mapping[str, ProbeState]) -> CatalogSnapshot:
    """`snapshot` with each instance's health the worst of its own and its probes' (by instance id)."""
    out = []
    for inst in snapshot.instances:
        st = states.get(inst.id)
        health = inst.health if st is None else Health.worst((inst.health, st.health))
        out.append(inst if health is inst.health else replace(inst, health=health))
    return CatalogSnapshot.of(out)
