"""The batching window at each simulated worker's admission (``FleetConfig.batching``).

A request routed to worker w (policy told at routing time, as with a data-plane fetch) waits in w's
``kvmesh.engine.batching.BatchWindow`` instead of being queued on w's engine; the window's release is an event
on the simulator's own heap at the window's due time, and the requests it releases are queued on the engine
in its order (shortest prompt first, packed under the token budget). A full window rejects the request like a
full engine queue. A release event made stale by an earlier one (a newcomer shortened the window) is ignored.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from kvmesh.core.errors import ResourceExhausted
from kvmesh.engine.batching import BatchWindow, WindowConfig
from kvmesh.routing.types import RoutingQuery

if TYPE_CHECKING:
    from kvmesh.fleet.sim import FleetSim


class FleetWindows:
    """One batching window per worker slot, and the due time of each slot's scheduled release."""

    def __init__(self, config: WindowConfig, workers: int) -> None:
        self.windows: list[BatchWindow[int]] = [BatchWindow(config) for _ in range(workers)]
        self.scheduled: list[float | None] = [None] * workers
        self.releases = 0
        self.released = 0

    def hold(self, sim: FleetSim, slot: int, i: int, rr: RoutingQuery | None) -> None:
        """Request i waits in worker ``slot``'s window (``rr`` None: the policy was told already)."""
        r = sim.trace.requests[i]
        if rr is not None:
            sim.policy.on_routed(rr, sim.ids[slot], sim.now)
        try:
            due = self.windows[slot].add(i, r.input_len, r.output_len, sim.now)
        except ResourceExhausted:
            sim.reject(slot, str(i), told=True)
            return
        self._schedule(sim, slot, due)

    def release(self, sim: FleetSim, slot: int, due: float) -> None:
        """The release event of worker ``slot`` scheduled for ``due``: queue what the window lets through."""
        if self.scheduled[slot] != due:
            return  # superseded by an earlier release
        self.scheduled[slot] = None
        win = self.windows[slot]
        batch = win.release(sim.now)
        self.releases += 1
        self.released += len(batch)
        for i in batch:
            sim.enter(slot, i, None)
        nxt = win.due()
        if nxt is not None:
            self._schedule(sim, slot, nxt)

    def _schedule(self, sim: FleetSim, slot: int, due: float) -> None:
        cur = self.scheduled[slot]
        if cur is not None and cur <= due:
            return
        self.scheduled[slot] = due
        sim.push_window(due, slot)

    def stats(self) -> dict[str, float]:
        return {
            "releases": self.releases,
            "released": self.released,
            "mean_release": self.released / self.releases if self.releases else 0.0,
        }
