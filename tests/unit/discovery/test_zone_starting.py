"""A starting zone (not yet healthy since the failover service's first look) is told apart from a failed one."""

from __future__ import annotations

import pytest

from kvmesh.core.errors import InvalidArgument
from kvmesh.discovery.model import Health
from kvmesh.discovery.zones import ZonePolicy, ZoneState, build_zone_views, step_zone, zone_reason
from tests.unit.discovery.test_zones import fleet, snap

pytestmark = pytest.mark.unit

POLICY = ZonePolicy(up_observations=2, up_hold_s=0, min_dwell_s=0, start_grace_s=60)
LOADING = {"w0": Health.CRITICAL, "w1": Health.CRITICAL}


def observe(prev: ZoneState | None, policy: ZonePolicy, now: float, **health: Health) -> tuple[ZoneState, str]:
    """One observation of zone `a` (a router, a cache-manager, two workers; `health` overrides): state, reason."""
    view = build_zone_views(snap(fleet("a", **health)), policy)["a"]
    state, _ = step_zone(prev, view, policy, now)
    return state, zone_reason(state, view)


def test_zone_loading_its_engines_is_starting_with_a_reason() -> None:
    state, reason = observe(None, POLICY, 0.0, **LOADING)
    assert state.starting and not state.healthy
    assert reason == "2 of 2 workers loading"
    state, reason = observe(state, POLICY, 1.0, w0=Health.CRITICAL, cm=Health.CRITICAL)
    assert state.starting and reason == "cache-manager starting; 1 of 2 workers loading"


def test_starting_zone_confirming_health_then_healthy() -> None:
    state, _ = observe(None, POLICY, 0.0, **LOADING)
    state, reason = observe(state, POLICY, 1.0)  # looks healthy: one of two observations
    assert state.starting and not state.healthy and reason == "up, confirming health"
    state, reason = observe(state, POLICY, 2.0)
    assert state.healthy and not state.starting and reason == ""


def test_zone_that_failed_after_being_healthy_is_unhealthy_not_starting() -> None:
    state, _ = observe(None, POLICY, 0.0)
    assert state.healthy and not state.starting
    state, reason = observe(state, POLICY, 1.0, **LOADING)
    assert not state.healthy and not state.starting
    assert reason.startswith("worker capacity 0/2")
    state, reason = observe(state, POLICY, 2.0)
    assert not state.starting and reason == "recovering, not yet confirmed healthy"


def test_starting_ends_after_the_grace() -> None:
    state, _ = observe(None, POLICY, 0.0, **LOADING)
    state, _ = observe(state, POLICY, 59.0, **LOADING)
    assert state.starting
    state, reason = observe(state, POLICY, 60.0, **LOADING)
    assert not state.starting and not state.healthy and reason.startswith("worker capacity 0/2")


def test_empty_zone_has_no_health_report_yet() -> None:
    view = build_zone_views(snap(), POLICY, ["b"])["b"]
    state, _ = step_zone(None, view, POLICY, 0.0)
    assert state.starting and zone_reason(state, view) == "no health report yet"


def test_start_grace_must_be_finite_and_non_negative() -> None:
    with pytest.raises(InvalidArgument) as e:
        ZonePolicy(start_grace_s=-1)
    assert e.value.field == "start_grace_s"
