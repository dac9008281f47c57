"""EndpointSet (client side): weights from a WatchEndpointsResponse and the weighted pick."""

from __future__ import annotations

import pytest

from kvmesh.client.endpoints import EndpointSet
from kvmesh.v1 import common_pb2, failover_pb2

pytestmark = pytest.mark.unit
R = common_pb2.SERVICE_ROLE_ROUTER


def resp(zw: dict[str, float], vw: dict[str, float], routers: list[tuple[str, str, str]]) -> EndpointSet:
    zones = [
        failover_pb2.ZoneEndpoints(
            zone=z,
            healthy=w > 0,
            weight=w,
            endpoints=[
                common_pb2.Endpoint(id=i, role=R, address=f"127.0.0.1:{1000 + n}", zone=z, version=v)
                for n, (i, rz, v) in enumerate(routers)
                if rz == z
            ],
        )
        for z, w in zw.items()
    ]
    return EndpointSet.from_response(failover_pb2.WatchEndpointsResponse(zones=zones, version_weights=vw, revision=3))


def test_weights_follow_zone_and_version_shares() -> None:
    eps = resp({"a": 0.5, "b": 0.5}, {"v1": 0.9, "v2": 0.1}, [("a1", "a", "v1"), ("a2", "a", "v2"), ("b1", "b", "v1")])
    assert eps.router_weights == pytest.approx({"a1": 0.45, "a2": 0.1, "b1": 0.45})
    assert eps.revision == 3


def test_pick_walks_the_cdf_and_respects_exclusions() -> None:
    eps = resp({"a": 0.25, "b": 0.75}, {"v1": 1}, [("a1", "a", "v1"), ("b1", "b", "v1")])
    counts = {"a1": 0, "b1": 0}
    n = 1000
    for k in range(n):
        inst = eps.pick((k + 0.5) / n)
        assert inst is not None
        counts[inst.id] += 1
    assert counts == {"a1": 250, "b1": 750}
    assert eps.pick(0.0, frozenset({"a1"})).id == "b1"  # type: ignore[union-attr]
    assert eps.pick(0.9, frozenset({"a1", "b1"})) is None


def test_zero_weight_zone_routers_are_a_last_resort() -> None:
    eps = resp({"a": 0.0, "b": 1.0}, {"v1": 1}, [("a1", "a", "v1"), ("b1", "b", "v1")])
    assert eps.router_weights == {"b1": 1.0}
    assert eps.pick(0.5).id == "b1"  # type: ignore[union-attr]
    assert eps.pick(0.5, frozenset({"b1"})).id == "a1"  # type: ignore[union-attr]


def test_static_bootstrap_set() -> None:
    eps = EndpointSet.static(["127.0.0.1:1", "127.0.0.1:2"])
    assert eps.router_weights == {"127.0.0.1:1": 0.5, "127.0.0.1:2": 0.5}
    assert eps.pick(0.99).target == "127.0.0.1:2"  # type: ignore[union-attr]


def test_a_preferred_zone_takes_its_clients_while_it_has_its_full_share() -> None:
    routers = [("a1", "a", "v1"), ("b1", "b", "v1")]
    even = resp({"a": 0.5, "b": 0.5}, {"v1": 1}, routers)
    assert {even.pick(u, prefer_zone="a", u_zone=0.99).id for u in (0.1, 0.9)} == {"a1"}  # type: ignore[union-attr]
    ramp = resp({"a": 0.2, "b": 0.8}, {"v1": 1}, routers)  # a ramping back: 0.2 / 0.8 of its clients stay home
    picks = [ramp.pick(0.9, prefer_zone="a", u_zone=(k + 0.5) / 100).id for k in range(100)]  # type: ignore[union-attr]
    assert picks.count("a1") == 25  # the rest are drawn by weight (u = 0.9 falls on b1)
    down = resp({"a": 0.0, "b": 1.0}, {"v1": 1}, routers)
    assert down.pick(0.1, prefer_zone="a", u_zone=0.0).id == "b1"  # type: ignore[union-attr]
