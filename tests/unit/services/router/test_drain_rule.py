"""A drain that would leave a zone with no worker in rotation is refused unless forced (`Frontend.drain`'s rule,
`last_in_rotation`, pure): the router's other workers (its zone's) count only when routable."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any, cast

import pytest

from kvmesh.core.errors import PermissionDenied
from kvmesh.core.handoff import WorkerRole
from kvmesh.routing import WorkerView
from kvmesh.routing.types import CircuitState
from kvmesh.security.identity import CallerRole, Identity
from kvmesh.services.router.core import RouterCore
from kvmesh.services.router.frontend import Frontend, below_floor, last_in_rotation

pytestmark = pytest.mark.unit


def test_the_last_routable_worker_of_a_zone_names_the_zone() -> None:
    views = [WorkerView("a-0", zone="a"), WorkerView("a-1", zone="a")]
    assert last_in_rotation(views, "a-0") is None  # a-1 still serves zone a
    assert last_in_rotation(views[:1], "a-0") == "a"  # the zone's only worker
    assert last_in_rotation(views, "nope") is None  # an unknown worker is the caller's NOT_FOUND


def test_every_worker_of_the_router_serves_its_zone_whatever_zone_it_names() -> None:
    """Workers that report another zone (or none) than the planned one still take this router's traffic."""
    views = [WorkerView("w0", zone=""), WorkerView("a-planned-1", zone="a")]
    assert last_in_rotation(views, "a-planned-1") is None


@pytest.mark.parametrize(
    "other",
    [
        WorkerView("a-1", zone="a", draining=True),
        WorkerView("a-1", zone="a", healthy=False),
        WorkerView("a-1", zone="a", circuit=CircuitState.OPEN),
    ],
)
def test_others_out_of_rotation_do_not_count(other: WorkerView) -> None:
    assert last_in_rotation([WorkerView("a-0", zone="a"), other], "a-0") == "a"


def test_a_half_open_circuit_is_still_in_rotation() -> None:
    other = WorkerView("a-1", zone="a", circuit=CircuitState.HALF_OPEN)
    assert last_in_rotation([WorkerView("a-0", zone="a"), other], "a-0") is None


def test_a_non_admin_drain_stops_at_the_floor() -> None:
    """`below_floor`: the planner's drains may take a pool of 4 down to ceil(0.5 · 4) = 2 in rotation, no lower;
    workers already out of rotation count against the floor too."""
    views = [WorkerView(f"w{i}") for i in range(4)]
    assert below_floor(views, "w0", 0.5) is None  # 3 left
    views[1].draining = True
    assert below_floor(views, "w0", 0.5) is None  # 2 left: the floor
    views[2].healthy = False
    assert below_floor(views, "w0", 0.5) == (1, 4, 2)  # 1 left of 4, below the floor of 2
    assert below_floor([WorkerView("only")], "only", 0.0) == (0, 1, 1)  # the floor is at least one worker


class _Pool:
    def __init__(self, views: list[WorkerView]) -> None:
        self.by_id = {v.id: _Handle(v) for v in views}

    async def settle(self) -> None:  # every worker known from the start
        return None

    def views(self, now: float) -> list[WorkerView]:
        return [h.view for h in self.by_id.values()]


class _Handle:
    def __init__(self, view: WorkerView) -> None:
        self.view = view


def _front(n: int) -> Frontend:
    core = SimpleNamespace(pool=_Pool([WorkerView(f"w{i}", zone="a") for i in range(n)]))
    return Frontend(cast(RouterCore, core), cast(Any, None), cast(Any, None), cast(Any, None), "m")


def test_a_planner_drains_down_to_the_floor_and_is_refused_below_it() -> None:
    """A rogue planner token drains a zone: the first drains pass, the one below the floor is PERMISSION_DENIED
    naming it; an admin still drains that worker (the zone's last needs force, as before)."""
    front = _front(4)
    planner = Identity(CallerRole.PLANNER, "planner-local")
    front.drain("w0", True, caller=planner)
    front.drain("w1", True, caller=planner)
    with pytest.raises(PermissionDenied, match=r"drain_floor: .*1 of the zone's 4 workers.*floor of 2.*planner"):
        front.drain("w2", True, caller=planner)
    with pytest.raises(PermissionDenied, match="drain_floor"):
        front.drain("w2", True, force=True, caller=planner)  # force is an admin's word, not a planner's
    assert not front.core.pool.by_id["w2"].view.draining
    front.drain("w2", True, caller=Identity(CallerRole.ADMIN, "operator"))
    assert front.core.pool.by_id["w2"].view.draining
    front.drain("w0", False, caller=planner)  # undraining is always allowed


def test_the_floor_counts_only_workers_that_serve_a_whole_request() -> None:
    """A prefill worker runs prefill halves only: with it and one decode worker in a zone, draining the decode
    worker leaves nothing to serve a request end to end, whatever the prefill worker's state; draining the
    prefill worker leaves every request servable (aggregated), so no floor stands in its way."""
    views = [WorkerView("p", zone="a", role=WorkerRole.PREFILL), WorkerView("d", zone="a", role=WorkerRole.DECODE)]
    assert below_floor(views, "d", 0.5) == (0, 1, 1)
    assert below_floor(views, "p", 0.5) is None
    assert last_in_rotation(views, "d") == "a"
    assert last_in_rotation(views, "p") is None
    pool = [
        *views,
        WorkerView("b", zone="a", role=WorkerRole.BOTH),
        WorkerView("p2", zone="a", role=WorkerRole.PREFILL),
    ]
    assert below_floor(pool, "d", 0.5) is None  # b serves: 1 of the 2 that can, the floor of ceil(0.5 · 2)
    assert last_in_rotation(pool, "d") is None
    pool[2].healthy = False
    assert below_floor(pool, "d", 0.5) == (0, 2, 1)
