"""Unit tests of the pure zone policy (kvmesh.discovery.zones / policy)."""

from __future__ import annotations

from dataclasses import replace

import pytest

from kvmesh.core.errors import InvalidArgument
from kvmesh.discovery.model import REPLICATION_PENDING_META, CatalogSnapshot, Health, Role, ServiceInstance
from kvmesh.discovery.policy import FailoverPolicy, router_weights
from kvmesh.discovery.zones import (
    ZonePolicy,
    build_zone_views,
    ramp_factor,
    step_zone,
    zone_weights,
)

pytestmark = pytest.mark.unit


def inst(
    iid: str, role: Role, zone: str, health: Health = Health.PASSING, version: str = "v1", cap: float = 1.0
) -> ServiceInstance:
    return ServiceInstance(iid, role, zone, version, "127.0.0.1", 1000 + len(iid), health, cap)


def fleet(zone: str, workers: int = 2, version: str = "v1", **health: Health) -> list[ServiceInstance]:
    """A full zone; `health` overrides by instance id suffix (router, cm, w0, w1...)."""
    out = [
        inst(f"{zone}-router", Role.ROUTER, zone, health.get("router", Health.PASSING), version),
        inst(f"{zone}-cm", Role.CACHE_MANAGER, zone, health.get("cm", Health.PASSING), version),
    ]
    out += [
        inst(f"{zone}-w{i}", Role.WORKER, zone, health.get(f"w{i}", Health.PASSING), version) for i in range(workers)
    ]
    return out


def snap(*groups: list[ServiceInstance]) -> CatalogSnapshot:
    return CatalogSnapshot.of(i for g in groups for i in g)


FAST = ZonePolicy(up_observations=1, up_hold_s=0, min_dwell_s=0, ramp_s=0)


def test_views_list_only_up_instances_and_zone_is_healthy() -> None:
    views = build_zone_views(snap(fleet("a", w1=Health.CRITICAL), fleet("b")), ZonePolicy())
    assert [w.id for w in views["a"].workers] == ["a-w0"]
    assert views["a"].worker_capacity_up == 1 and views["a"].worker_capacity_total == 2
    assert views["a"].healthy  # 1/2 >= 0.5
    assert views["b"].healthy and views["b"].reasons == ()


@pytest.mark.parametrize(
    ("override", "reason"),
    [
        ({"router": Health.CRITICAL}, "no passing router"),
        ({"cm": Health.CRITICAL}, "no passing cache-manager"),
        ({"w0": Health.CRITICAL, "w1": Health.CRITICAL, "w2": Health.CRITICAL}, "worker capacity 1/4"),
    ],
)
def test_zone_unhealthy_rules(override: dict[str, Health], reason: str) -> None:
    views = build_zone_views(snap(fleet("a", workers=4, **override)), ZonePolicy(min_worker_fraction=0.5))
    assert not views["a"].healthy
    assert any(r.startswith(reason) for r in views["a"].reasons), views["a"].reasons


def test_warning_counts_as_up_only_when_configured() -> None:
    s = snap(fleet("a", router=Health.WARNING))
    assert build_zone_views(s, ZonePolicy(warning_is_up=True))["a"].healthy
    assert not build_zone_views(s, ZonePolicy(warning_is_up=False))["a"].healthy


def test_expected_capacity_and_configured_zone_without_instances() -> None:
    pol = ZonePolicy(expected_capacity={"a": 4.0})
    views = build_zone_views(snap(fleet("a", workers=1)), pol, zones=["b"])
    assert not views["a"].healthy  # 1 of expected 4
    assert not views["b"].healthy and "no passing router" in views["b"].reasons


def test_failing_flips_on_first_observation_by_default() -> None:
    pol = ZonePolicy()
    bad = build_zone_views(snap(fleet("a", router=Health.CRITICAL)), pol)["a"]
    good = build_zone_views(snap(fleet("a")), pol)["a"]
    s0, _ = step_zone(None, good, pol, now=0.0)
    s1, tr = step_zone(s0, bad, pol, now=1.0)
    assert not s1.healthy and tr is not None and not tr.healthy and tr.duration_s == 0


def test_hysteresis_needs_n_observations_hold_and_dwell_to_come_back() -> None:
    pol = ZonePolicy(up_observations=3, up_hold_s=2.0, min_dwell_s=10.0)
    bad = build_zone_views(snap(fleet("a", router=Health.CRITICAL)), pol)["a"]
    good = build_zone_views(snap(fleet("a")), pol)["a"]
    s, _ = step_zone(None, good, pol, 0.0)
    s, _ = step_zone(s, bad, pol, 1.0)  # down at t=1
    assert not s.healthy
    # three good observations in quick succession: count reached but hold/dwell not
    for t in (2.0, 2.1, 2.2):
        s, tr = step_zone(s, good, pol, t)
        assert tr is None and not s.healthy
    s, tr = step_zone(s, good, pol, 4.5)  # hold ok (2.5 s) but dwell 3.5 s < 10
    assert tr is None and not s.healthy
    s, tr = step_zone(s, good, pol, 11.0)
    assert s.healthy and tr is not None and tr.detected_at == 2.0 and tr.duration_s == pytest.approx(9.0)


def test_flapping_resets_the_pending_count() -> None:
    pol = ZonePolicy(up_observations=2, up_hold_s=0, min_dwell_s=0)
    bad = build_zone_views(snap(fleet("a", cm=Health.CRITICAL)), pol)["a"]
    good = build_zone_views(snap(fleet("a")), pol)["a"]
    s, _ = step_zone(None, bad, pol, 0.0)
    s, tr = step_zone(s, good, pol, 1.0)
    assert tr is None
    s, tr = step_zone(s, bad, pol, 2.0)  # flap: pending reset
    assert s.pending_count == 0
    s, tr = step_zone(s, good, pol, 3.0)
    assert tr is None and not s.healthy
    s, tr = step_zone(s, good, pol, 4.0)
    assert tr is not None and s.healthy


def test_down_observations_debounce() -> None:
    pol = ZonePolicy(down_observations=2)
    bad = build_zone_views(snap(fleet("a", router=Health.CRITICAL)), pol)["a"]
    good = build_zone_views(snap(fleet("a")), pol)["a"]
    s, _ = step_zone(None, good, pol, 0.0)
    s, tr = step_zone(s, bad, pol, 1.0)
    assert tr is None and s.healthy
    s, tr = step_zone(s, bad, pol, 1.5)
    assert tr is not None and not s.healthy


def test_unhealthy_zone_weight_goes_to_healthy_zones_in_proportion() -> None:
    fp = FailoverPolicy.create(FAST, {"a": 2, "b": 1, "c": 1}, {"v1": 1})
    d = fp.observe(snap(fleet("a"), fleet("b"), fleet("c")), 0.0)
    assert d.zone_weights == pytest.approx({"a": 0.5, "b": 0.25, "c": 0.25})
    d = fp.observe(snap(fleet("a", router=Health.CRITICAL), fleet("b"), fleet("c")), 1.0)
    assert d.zone_weights == pytest.approx({"a": 0.0, "b": 0.5, "c": 0.5})
    assert [t.zone for t in d.transitions] == ["a"]
    assert "a-router" not in d.router_weights
    assert sum(d.router_weights.values()) == pytest.approx(1.0)


def test_gradual_come_back_ramps_linearly() -> None:
    pol = ZonePolicy(up_observations=1, up_hold_s=0, min_dwell_s=0, ramp_s=10, ramp_floor=0.0)
    fp = FailoverPolicy.create(pol, {"a": 1, "b": 1}, {"v1": 1})
    fp.observe(snap(fleet("a"), fleet("b")), 0.0)
    fp.observe(snap(fleet("a", router=Health.CRITICAL), fleet("b")), 1.0)
    d = fp.observe(snap(fleet("a"), fleet("b")), 2.0)  # restored at t=2
    assert fp.states["a"].restored_at == 2.0
    assert d.zone_weights["a"] == pytest.approx(0.0)
    d = fp.observe(fp.snapshot, 7.0)  # r = 0.5 -> a: 0.5/(0.5+1)
    assert d.zone_weights["a"] == pytest.approx(1 / 3)
    d = fp.observe(fp.snapshot, 12.0)
    assert d.zone_weights == pytest.approx({"a": 0.5, "b": 0.5})
    assert ramp_factor(fp.states["a"], pol, 100.0) == 1.0


def replicating(zone: str, *into: str) -> list[ServiceInstance]:
    """A full zone whose cache-manager has not finished replicating into the zones `into`."""
    out = fleet(zone)
    out[1] = replace(out[1], meta={REPLICATION_PENDING_META: ",".join(into)})
    return out


def test_views_list_the_zones_still_replicating_into_a_zone() -> None:
    b = replicating("b", "a", "c", "b")  # its own zone is not a target
    b.append(replace(inst("b-cm2", Role.CACHE_MANAGER, "b", Health.CRITICAL), meta={REPLICATION_PENDING_META: "d"}))
    views = build_zone_views(snap(fleet("a"), b, replicating("c", "a")), ZonePolicy(), ["d"])
    assert views["a"].rewarm_from == ("b", "c")
    assert views["b"].rewarm_from == ()
    assert views["c"].rewarm_from == ("b",)
    assert views["d"].rewarm_from == ()  # only an up cache-manager's meta counts


def test_restored_zone_is_held_at_the_floor_until_the_other_zones_rewarmed_it() -> None:
    pol = ZonePolicy(up_observations=1, up_hold_s=0, min_dwell_s=0, ramp_s=10, ramp_floor=0.1)
    fp = FailoverPolicy.create(pol, {"a": 1, "b": 1}, {"v1": 1})
    fp.observe(snap(fleet("a"), replicating("b", "a")), 0.0)  # a never went down: no hold, whatever b says
    assert fp.states["a"].ramp_from is None and not fp.states["a"].rewarm_hold
    assert ramp_factor(fp.states["a"], pol, 0.0) == 1.0
    fp.observe(snap(fleet("a", router=Health.CRITICAL), replicating("b", "a")), 1.0)
    d = fp.observe(snap(fleet("a"), replicating("b", "a")), 2.0)  # restored at t=2, b still replicating
    assert fp.states["a"].rewarm_hold
    assert d.zone_weights["a"] == pytest.approx(0.1 / 1.1)
    d = fp.observe(snap(fleet("a"), replicating("b", "a")), 30.0)  # held however long the ramp would take
    assert fp.states["a"].rewarm_hold and d.zone_weights["a"] == pytest.approx(0.1 / 1.1)
    d = fp.observe(snap(fleet("a"), fleet("b")), 31.0)  # re-warmed: the ramp starts now, from the floor
    assert fp.states["a"].ramp_from == 31.0 and not fp.states["a"].rewarm_hold
    assert d.zone_weights["a"] == pytest.approx(0.1 / 1.1)
    d = fp.observe(fp.snapshot, 36.0)  # r = 0.1 + 0.9 * 0.5
    assert d.zone_weights["a"] == pytest.approx(0.55 / 1.55)
    d = fp.observe(snap(fleet("a"), replicating("b", "a")), 37.0)  # pending again later: no new hold
    assert d.zone_weights["a"] == pytest.approx(0.64 / 1.64)
    assert fp.observe(fp.snapshot, 41.0).zone_weights == pytest.approx({"a": 0.5, "b": 0.5})


def test_rewarm_hold_ends_at_its_timeout_and_a_zero_timeout_never_holds() -> None:
    pol = ZonePolicy(up_observations=1, up_hold_s=0, min_dwell_s=0, ramp_s=10, ramp_floor=0.0, rewarm_timeout_s=20)
    fp = FailoverPolicy.create(pol, {"a": 1, "b": 1}, {"v1": 1})
    fp.observe(snap(fleet("a"), fleet("b")), 0.0)
    fp.observe(snap(fleet("a", router=Health.CRITICAL), replicating("b", "a")), 1.0)
    fp.observe(snap(fleet("a"), replicating("b", "a")), 2.0)
    fp.observe(snap(fleet("a"), replicating("b", "a")), 21.9)
    assert fp.states["a"].rewarm_hold
    fp.observe(snap(fleet("a"), replicating("b", "a")), 22.0)  # 20 s after the restore
    assert fp.states["a"].ramp_from == 22.0
    assert fp.observe(fp.snapshot, 27.0).zone_weights["a"] == pytest.approx(0.5 / 1.5)
    never = replace(pol, rewarm_timeout_s=0)
    fp = FailoverPolicy.create(never, {"a": 1, "b": 1}, {"v1": 1})
    fp.observe(snap(fleet("a"), fleet("b")), 0.0)
    fp.observe(snap(fleet("a", router=Health.CRITICAL), replicating("b", "a")), 1.0)
    fp.observe(snap(fleet("a"), replicating("b", "a")), 2.0)
    assert fp.states["a"].ramp_from == 2.0 and not fp.states["a"].rewarm_hold
    with pytest.raises(InvalidArgument, match="rewarm_timeout_s"):
        ZonePolicy(rewarm_timeout_s=-1)


def test_all_zones_down_falls_back_to_degraded_zones_with_a_router() -> None:
    fp = FailoverPolicy.create(FAST, {"a": 1, "b": 1}, {"v1": 1})
    d = fp.observe(snap(fleet("a", cm=Health.CRITICAL), fleet("b", router=Health.CRITICAL)), 0.0)
    assert d.zone_weights == {"a": 1.0, "b": 0.0}
    assert d.router_weights == {"a-router": 1.0}


def test_standby_zone_takes_over_when_weighted_zone_fails() -> None:
    fp = FailoverPolicy.create(FAST, {"a": 1, "b": 0}, {"v1": 1})
    d = fp.observe(snap(fleet("a"), fleet("b")), 0.0)
    assert d.zone_weights == {"a": 1.0, "b": 0.0}
    d = fp.observe(snap(fleet("a", router=Health.CRITICAL), fleet("b")), 1.0)
    assert d.zone_weights == {"a": 0.0, "b": 1.0}


def test_nothing_serves_gives_empty_router_weights() -> None:
    fp = FailoverPolicy.create(FAST, {"a": 1}, {"v1": 1})
    d = fp.observe(snap(fleet("a", router=Health.CRITICAL)), 0.0)
    assert d.zone_weights == {"a": 0.0} and d.router_weights == {}


def test_router_weights_split_versions_globally_then_zones() -> None:
    routers = [
        inst("a-r1", Role.ROUTER, "a", version="v1"),
        inst("a-r2", Role.ROUTER, "a", version="v2"),
        inst("b-r1", Role.ROUTER, "b", version="v1"),
        inst("b-r1b", Role.ROUTER, "b", version="v1"),
    ]
    views = build_zone_views(CatalogSnapshot.of(routers), ZonePolicy())
    w = router_weights(views, {"a": 0.5, "b": 0.5}, {"v1": 0.9, "v2": 0.1})
    assert w["a-r2"] == pytest.approx(0.1)  # only zone a has v2: it gets the whole v2 share
    assert w["a-r1"] == pytest.approx(0.45)
    assert w["b-r1"] == pytest.approx(0.225) and w["b-r1b"] == pytest.approx(0.225)
    assert sum(w.values()) == pytest.approx(1.0)


def test_invalid_policy_is_invalid_argument() -> None:
    with pytest.raises(InvalidArgument) as e:
        ZonePolicy(min_worker_fraction=1.5)
    assert e.value.field == "min_worker_fraction"
    with pytest.raises(InvalidArgument):
        ZonePolicy(up_observations=0)


def test_zone_weights_unknown_zone_in_base_ignored() -> None:
    pol = FAST
    views = build_zone_views(snap(fleet("a")), pol)
    s, _ = step_zone(None, views["a"], pol, 0.0)
    assert zone_weights({"a": s}, views, {"a": 1.0, "zz": 3.0}, pol, 0.0) == {"a": 1.0}


def test_cache_manager_requirement_can_be_switched_off() -> None:
    s = snap(fleet("a", cm=Health.CRITICAL))
    assert not build_zone_views(s, ZonePolicy())["a"].healthy
    assert build_zone_views(s, ZonePolicy(require_cache_manager=False))["a"].healthy
