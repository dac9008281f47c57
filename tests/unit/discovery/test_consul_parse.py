"""Pure helpers of the Consul adapter and of the Consul stand-in: entries, check bodies, durations."""

from __future__ import annotations

import pytest

from kvmesh.discovery.consul import go_duration, grpc_check, parse_health_entry, ttl_check
from kvmesh.discovery.model import Health, Role, ServiceInstance
from kvmesh.discovery.registry import CheckSpec
from tests.consul_standin.server import norm, parse_duration

pytestmark = pytest.mark.unit


def entry(checks: list[str], tags: list[str], meta: dict[str, str], address: str = "") -> dict[str, object]:
    return {
        "Node": {"Node": "n1", "Address": "10.0.0.9"},
        "Service": {
            "ID": "r1",
            "Service": "kvmesh-router",
            "Tags": tags,
            "Meta": meta,
            "Address": address,
            "Port": 7000,
        },
        "Checks": [{"CheckID": f"c{i}", "Status": s} for i, s in enumerate(checks)],
    }


def test_health_is_worst_check_and_meta_wins_over_tags() -> None:
    inst = parse_health_entry(entry(["passing", "warning"], ["zone=a", "version=v1"], {"zone": "b"}))
    assert inst is not None
    assert (inst.zone, inst.version, inst.role, inst.health) == ("b", "v1", Role.ROUTER, Health.WARNING)
    assert inst.address == "10.0.0.9"  # empty service address falls back to the node's, as in Consul
    crit = parse_health_entry(entry(["passing", "critical"], ["zone=a"], {}, "127.0.0.1"))
    assert crit is not None and crit.health is Health.CRITICAL and crit.address == "127.0.0.1"
    maint = parse_health_entry(entry(["maintenance"], ["zone=a"], {}))
    assert maint is not None and maint.health is Health.CRITICAL
    assert parse_health_entry(entry(["passing"], [], {})) is None  # no zone: not a valid kvmesh instance


def test_foreign_service_is_ignored() -> None:
    e = entry(["passing"], [], {})
    e["Service"] = {"ID": "x", "Service": "web", "Tags": [], "Port": 80}  # type: ignore[index]
    assert parse_health_entry(e) is None


def test_check_bodies_use_consul_field_names() -> None:
    inst = ServiceInstance("w1", Role.WORKER, "a", "v1", "127.0.0.1", 5000)
    g = grpc_check(
        inst, CheckSpec(interval_s=0.25, timeout_s=1, use_tls=True, grpc_service="svc", deregister_after_s=90)
    )
    assert g == {
        "CheckID": "service:w1",
        "Name": "kvmesh-worker gRPC health",
        "GRPC": "127.0.0.1:5000/svc",
        "GRPCUseTLS": True,
        "Interval": "250ms",
        "Timeout": "1000ms",
        "DeregisterCriticalServiceAfter": "90000ms",
    }
    t = ttl_check(inst, CheckSpec(mode="ttl", ttl_s=3))
    assert t["TTL"] == "3000ms" and t["Status"] == "critical"
    assert go_duration(0.0001) == "1ms"


def test_standin_duration_and_key_normalisation() -> None:
    assert parse_duration("1m30s") == 90.0
    assert parse_duration("250ms") == 0.25
    assert parse_duration(1_500_000_000) == 1.5
    with pytest.raises(ValueError):
        parse_duration("10 seconds")
    assert norm({"GRPCUseTLS": 1, "grpc_use_tls": 2, "DeregisterCriticalServiceAfter": 3}) == {
        "grpcusetls": 2,
        "deregistercriticalserviceafter": 3,
    }
