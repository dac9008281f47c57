"""The admin CLI's pure parts: replies → documents (`views`), documents → text (`render`), targets and
credentials (`target`), and how a failed call is explained (`calls.explain`)."""

from __future__ import annotations

import argparse
from pathlib import Path

import grpc
import pytest

from kvmesh.rpc.channel import ChannelSecurity
from kvmesh.suite.admin import calls, render, target, views
from kvmesh.v1 import cache_manager_pb2, common_pb2, failover_pb2, router_pb2


def _list_workers() -> router_pb2.ListWorkersResponse:
    reply = router_pb2.ListWorkersResponse(prefill_weight=0.7, decode_weight=0.3)
    for i, (draining, circuit) in enumerate(((False, "closed"), (True, "half_open"))):
        w = reply.workers.add(circuit=circuit, draining=draining, in_flight=i, selections_total=10 * i + 3)
        w.endpoint.CopyFrom(
            common_pb2.Endpoint(
                id=f"w{i}", address=f"h:{i}", zone="a", version="v1", health=common_pb2.HEALTH_STATE_PASSING
            )
        )
        w.load.CopyFrom(
            common_pb2.LoadReport(running=2, waiting=i, kv_usage=0.25, kv_blocks_used=64, kv_blocks_total=256)
        )
        w.load.decode_latency_p95_ms = 12.345
        w.load.prefix_hit_rate = 0.5
    return reply


def test_workers_document_and_table() -> None:
    doc = views.workers(_list_workers(), "r:1")
    assert [w["state"] for w in doc["workers"]] == ["passing", "draining"]
    assert doc["workers"][1]["circuit"] == "half_open" and doc["workers"][1]["selections_total"] == 13
    assert doc["workers"][0]["kv_blocks_total"] == 256
    text = render.workers(doc)
    lines = text.splitlines()
    assert lines[0] == "router r:1  prefill weight 0.70  decode weight 0.30  workers 2"
    head = "WORKER ZONE STATE CIRCUIT RUN WAIT KV USE IN-FLIGHT SELECTED P95 MS HIT"
    assert lines[1].split() == head.split()
    assert lines[2].split() == ["w0", "a", "passing", "closed", "2", "0", "25%", "64/256", "0", "3", "12.35", "50%"]
    assert lines[3].split()[2:4] == ["draining", "half_open"]
    assert all(line == line.rstrip() for line in lines)


def test_table_aligns_numbers_right_and_text_left() -> None:
    assert render.table(["N", "NAME"], [[5, "a"], [100, "bbb"]]).splitlines() == ["  N  NAME", "  5  a", "100  bbb"]
    assert render.table(["A", "B"], [[None, True]]).splitlines()[1] == "-  yes"


def test_ago() -> None:
    assert [render.ago(s, 1000.0) for s in (0.0, 990.0, 880.0)] == ["-", "10s", "2m"]
    assert render.ago(1.0, 1.0 + 7200) == "2h" and render.ago(1.0, 1.0 + 2 * 86400) == "2d"


def _zones_doc() -> dict[str, object]:
    health = failover_pb2.GetZoneHealthResponse(registry_reachable=True)
    health.zones.add(zone="a", healthy=True, routers=1, cache_managers=1, workers=2, since=900.0)
    health.zones.add(zone="b", healthy=False, reason="no router", since=990.0)
    health.zones.add(zone="c", healthy=True, routers=1, cache_managers=1, workers=1, since=995.0, rewarm_hold=True)
    health.zones[2].rewarm_pending_from.append("a")
    health.zones.add(zone="d", healthy=False, starting=True, reason="2 of 2 workers loading", routers=1, since=997.0)
    weights = failover_pb2.TrafficWeights(zone_weights={"a": 1.0}, version_weights={"v2": 0.1, "v1": 0.9})
    return views.zones(health, weights, "f:1")


def test_zones_join_health_and_weights() -> None:
    doc = _zones_doc()
    assert [(z["zone"], z["weight"]) for z in doc["zones"]][:3] == [("a", 1.0), ("b", None), ("c", None)]  # type: ignore[attr-defined]
    assert doc["zones"][2]["rewarm_pending_from"] == ["a"]  # type: ignore[index]
    assert list(doc["version_weights"]) == ["v1", "v2"]  # type: ignore[call-overload]
    lines = render.zones(doc, now=1000.0).splitlines()
    assert lines[0] == "failover f:1  registry reachable"
    assert lines[2].split() == ["a", "healthy", "1.000", "1", "1", "2", "1m", "-"]
    assert lines[3].split() == ["b", "UNHEALTHY", "-", "0", "0", "0", "10s", "no", "router"]
    assert lines[4].split() == ["c", "re-warming", "-", "1", "1", "1", "5s", "re-warm", "pending", "from", "a"]
    assert lines[5].split() == ["d", "STARTING", "-", "1", "0", "0", "3s", "2", "of", "2", "workers", "loading"]
    assert lines[6] == "version weights: v1 0.900, v2 0.100"


def test_weights_text() -> None:
    doc = views.traffic_weights(failover_pb2.TrafficWeights(zone_weights={"b": 0.25, "a": 0.75}))
    assert render.weights(doc).splitlines()[1:] == ["zone  a     0.750", "zone  b     0.250"]
    assert render.weights(views.traffic_weights(failover_pb2.TrafficWeights())) == "no traffic weights set"


def test_index_with_its_top_prefixes() -> None:
    stats = cache_manager_pb2.GetStatsResponse(workers=2, blocks=10, pairs=15, hit_ratio=0.875, block_size=32)
    stats.top_prefixes.add(key=0xAB, blocks=4, window_count=7, total=9, last_seen=5.0, tenant="alice")
    policy = cache_manager_pb2.WarmingPolicy(hot_threshold=5, window_s=60, max_replicas=4, capacity=100, lfu_weight=0.5)
    doc = views.index(stats, policy, "c:1")
    assert doc["warming_policy"]["capacity"] == 100
    assert doc["top_prefixes"] == [
        {"key": "00000000000000ab", "blocks": 4, "tokens": 128, "window_count": 7, "total": 9, "last_seen": 5.0}
        | {"tenant": "alice"}
    ]
    lines = render.index(doc).splitlines()
    assert lines[2].split() == ["2", "10", "15", "88%", "0", "0", "0", "0"]
    assert lines[3] == "warming: hot at 5 hits in 60s, up to 4 replicas, 100 prefixes kept warm, LFU weight 0.50"
    assert lines[4] == "top 1 prefixes in the last 60s:"
    assert lines[6].split() == ["00000000000000ab", "4", "128", "7", "9", "alice"]
    del stats.top_prefixes[:]
    assert render.index(views.index(stats, policy, "c:1")).endswith("no prefix queried in the last 60s")
    stats.zone = "b"
    stats.followed_zones.add(zone="a", address="a:1", revision=7, connected=True, lag_s=0.0021, blocks=40, resumes=1)
    lines = render.index(views.index(stats, policy, "c:1")).splitlines()
    assert lines[-3] == "zones followed by zone b:"
    assert lines[-1].split() == ["a", "a:1", "yes", "7", "2.1", "40", "0", "1"]


def test_top_frame_shows_each_part_or_its_error() -> None:
    frame = {
        "time": 3600.0 * 13 + 61,
        "workers": views.workers(_list_workers(), "r:1"),
        "zones": {"error": "cannot reach the failover at f:1"},
    }
    text = render.top_frame(frame, 2, 5)
    assert text.startswith("kvmesh top  13:01:01 UTC  frame 2/5\nrouter r:1")
    assert "zones: cannot reach the failover at f:1" in text
    assert "index" not in text  # not asked for (no cache-manager address)
    assert render.top_frame({"time": 0.0}, 1, None).startswith("kvmesh top  00:00:00 UTC  frame 1\n")


def _args(**kw: object) -> argparse.Namespace:
    p = argparse.ArgumentParser()
    target.add_arguments(p)
    ns = p.parse_args([])
    for k, v in kw.items():
        setattr(ns, k, v)
    return ns


@pytest.fixture
def no_env(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> Path:
    for var in ("ROUTER", "FAILOVER", "CACHE_MANAGER", "TOKEN", "TOKEN_FILE", "API_KEY", "CA", "CERT", "KEY"):
        monkeypatch.delenv(f"KVMESH_{var}", raising=False)
    monkeypatch.setenv("KVMESH_HOME", str(tmp_path))
    return tmp_path


def _suite(home: Path, tls: bool = False) -> None:
    (home / "run").mkdir(parents=True)
    (home / "run" / "admin.token").write_text("admin-secret\n")
    auth: dict[str, object] = {"tokens": {"admin": str(home / "run" / "admin.token")}, "tls": None}
    if tls:
        auth["tls"] = {"ca": "ca.pem", "admin": ["adm.pem", "adm.key"]}
    import json

    services = [{"name": "router", "grpc": "127.0.0.1:5"}, {"name": "failover", "grpc": "127.0.0.1:6"}]
    (home / "run" / "suite.json").write_text(json.dumps({"services": services, "auth": auth}))


def test_target_from_the_suite_with_its_admin_credential(no_env: Path) -> None:
    _suite(no_env)
    t = target.resolve(_args(), "router")
    assert t is not None and t.address == "127.0.0.1:5" and t.security == ChannelSecurity(token="admin-secret")
    assert target.resolve(_args(), "cache-manager", required=False) is None
    with pytest.raises(target.AdminError, match=r"no cache-manager in .*--cache-manager HOST:PORT") as e:
        target.resolve(_args(), "cache-manager")
    assert e.value.exit_code == target.EXIT_USAGE
    client = target.resolve(_args(token="client-secret"), "failover")  # a flag's credential replaces the suite's
    assert client is not None and client.security.token == "client-secret"


def test_tls_suite_presents_the_admin_certificate(no_env: Path) -> None:
    _suite(no_env, tls=True)
    t = target.resolve(_args(), "router")
    assert t is not None and t.security == ChannelSecurity("ca.pem", "adm.pem", "adm.key", "admin-secret")


def test_suite_credential_never_goes_to_an_address_given_by_hand(no_env: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    _suite(no_env)
    t = target.resolve(_args(router="remote:443"), "router")
    assert t is not None and t.source == "flag" and t.security == ChannelSecurity()
    monkeypatch.setenv("KVMESH_FAILOVER", "fo:1")
    monkeypatch.setenv("KVMESH_API_KEY", "sk-admin")
    t = target.resolve(_args(ca="ca.pem"), "failover")
    assert t is not None and (t.address, t.source) == ("fo:1", "env")
    assert t.security == ChannelSecurity(tls_ca="ca.pem", token="sk-admin")


def test_no_suite_and_no_address_is_a_usage_error(no_env: Path) -> None:
    with pytest.raises(target.AdminError, match=r"no local suite .*`kvmesh up`") as e:
        target.resolve(_args(), "router")
    assert e.value.exit_code == 2


def test_bad_credentials_are_usage_errors(no_env: Path) -> None:
    with pytest.raises(target.AdminError, match="go together"):
        target.resolve(_args(router="r:1", cert="c.pem"), "router")
    with pytest.raises(target.AdminError, match="need --ca"):
        target.resolve(_args(router="r:1", cert="c.pem", key="k.pem"), "router")
    with pytest.raises(target.AdminError, match="cannot read auth_token_file") as e:
        target.resolve(_args(router="r:1", token_file=str(no_env / "absent")), "router")
    assert e.value.exit_code == 2


class _Err(grpc.RpcError):
    def __init__(self, code: grpc.StatusCode, details: str) -> None:
        self._code, self._details = code, details

    def code(self) -> grpc.StatusCode:
        return self._code

    def details(self) -> str:
        return self._details


@pytest.mark.parametrize(
    ("code", "exit_code", "says"),
    [
        (grpc.StatusCode.PERMISSION_DENIED, 3, "M on the router at r:1: PERMISSION_DENIED, needs role admin (why)"),
        (grpc.StatusCode.UNAUTHENTICATED, 3, "UNAUTHENTICATED, needs role admin; give an admin credential"),
        (grpc.StatusCode.UNAVAILABLE, 4, "cannot reach the router at r:1 (flag, TLS): UNAVAILABLE: why"),
        (grpc.StatusCode.NOT_FOUND, 1, "M on the router at r:1: NOT_FOUND: why"),
    ],
)
def test_explain(code: grpc.StatusCode, exit_code: int, says: str) -> None:
    t = target.Target("router", "r:1", ChannelSecurity(tls_ca="ca.pem"), "flag")
    err = calls.explain(_Err(code, "why"), t, "M")
    assert err.exit_code == exit_code and says in str(err)
