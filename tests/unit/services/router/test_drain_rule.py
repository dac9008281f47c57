"""A drain that would leave a zone with no worker in rotation is refused unless forced (`Frontend.drain`'s rule,
`last_in_rotation`, pure): the router's other workers (its zone's) count only when routable."""

from __future__ import annotations

import pytest

from kvmesh.routing import WorkerView
from kvmesh.routing.types import CircuitState
from kvmesh.services.router.frontend import last_in_rotation

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
