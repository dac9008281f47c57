"""Unit tests of traffic weights: validation, the upgrade path, rollback, version shares."""

from __future__ import annotations

import math

import pytest

from kvmesh.core.errors import FailedPrecondition, InvalidArgument
from kvmesh.discovery.model import CatalogSnapshot, Role, ServiceInstance
from kvmesh.discovery.policy import FailoverPolicy
from kvmesh.discovery.traffic import (
    UPGRADE_STEPS_PCT,
    TrafficPlan,
    canary_step,
    next_upgrade_pct,
    normalise_weights,
    version_shares,
)
from kvmesh.discovery.zones import ZonePolicy

pytestmark = pytest.mark.unit


@pytest.mark.parametrize(
    ("weights", "field"),
    [
        ({"v1": -1.0, "v2": 2.0}, "version_weights[v1]"),
        ({"v1": 0.0, "v2": 0.0}, "version_weights"),
        ({}, "version_weights"),
        ({"v1": math.nan}, "version_weights[v1]"),
        ({"v1": math.inf}, "version_weights[v1]"),
    ],
)
def test_invalid_weights_are_invalid_argument(weights: dict[str, float], field: str) -> None:
    with pytest.raises(InvalidArgument) as e:
        normalise_weights("version_weights", weights)
    assert e.value.field == field


def test_normalise() -> None:
    assert normalise_weights("w", {"b": 3, "a": 1}) == {"a": 0.25, "b": 0.75}


def test_upgrade_path_and_one_call_rollback() -> None:
    plan = TrafficPlan.initial("version_weights", {"v1": 1})
    seen = []
    share = 0.0
    for _ in range(len(UPGRADE_STEPS_PCT)):
        pct = next_upgrade_pct(share)
        plan = plan.set("version_weights", canary_step("v1", "v2", pct))
        share = plan.weights["v2"]
        seen.append(round(share * 100))
    assert seen == [5, 10, 50, 100]
    assert plan.weights == {"v1": 0.0, "v2": 1.0}  # old version kept on standby with weight 0
    assert plan.generation == 4
    back = plan.rollback()
    assert back.weights == pytest.approx({"v1": 0.5, "v2": 0.5})
    assert back.generation == 5
    # an invalid set leaves the plan untouched
    with pytest.raises(InvalidArgument):
        back.set("version_weights", {"v1": -1})
    assert back.rollback().rollback().rollback().weights == {"v1": 1.0}
    with pytest.raises(FailedPrecondition):
        back.rollback().rollback().rollback().rollback()


def test_canary_step_validation() -> None:
    with pytest.raises(InvalidArgument):
        canary_step("v1", "v1", 5)
    with pytest.raises(InvalidArgument):
        canary_step("v1", "v2", 0)
    with pytest.raises(InvalidArgument):
        canary_step("v1", "v2", 150)


def test_version_shares_standby_takes_over_only_when_needed() -> None:
    w = {"v1": 0.0, "v2": 1.0}
    assert version_shares(w, {"v1", "v2"}) == {"v2": 1.0}
    assert version_shares(w, {"v1"}) == {"v1": 1.0}  # standby serves when v2 is gone
    assert version_shares({"v1": 0.95, "v2": 0.05}, {"v1", "v2"}) == pytest.approx({"v1": 0.95, "v2": 0.05})
    assert version_shares(w, set()) == {}


def _routers() -> CatalogSnapshot:
    out = []
    for z in ("a", "b"):
        for v in ("v1", "v2"):
            out.append(ServiceInstance(f"{z}-r-{v}", Role.ROUTER, z, v, "127.0.0.1", 1))
        out.append(ServiceInstance(f"{z}-cm", Role.CACHE_MANAGER, z, "v1", "127.0.0.1", 2))
        out.append(ServiceInstance(f"{z}-w", Role.WORKER, z, "v1", "127.0.0.1", 3))
    return CatalogSnapshot.of(out)


def _version_share(d_weights: dict[str, float], version: str) -> float:
    return sum(w for k, w in d_weights.items() if k.endswith(version))


def test_version_weight_change_moves_that_share_and_rollback_restores() -> None:
    fp = FailoverPolicy.create(ZonePolicy(), {"a": 1, "b": 1}, {"v1": 1, "v2": 0})
    d0 = fp.observe(_routers(), 0.0)
    assert _version_share(dict(d0.router_weights), "v2") == 0.0
    fp.set_version_weights({"v1": 90, "v2": 10})
    d1 = fp.observe(fp.snapshot, 1.0)
    assert _version_share(dict(d1.router_weights), "v2") == pytest.approx(0.10)
    assert d1.version_generation == 1
    fp.rollback_versions()
    d2 = fp.observe(fp.snapshot, 2.0)
    assert dict(d2.router_weights) == pytest.approx(dict(d0.router_weights))
    with pytest.raises(InvalidArgument):
        fp.set_zone_weights({"a": -1, "b": 2})
    with pytest.raises(InvalidArgument):
        fp.set_zone_weights({"a": 0, "b": 0})
