"""The admin CLI's pure parts: replies → documents (`views`), documents → text (`render`), targets and
credentials (`target`), and how a failed call is explained (`calls.explain`)."""

from __future__ import annotations

import argparse
from pathlib import Path

import grpc
import pytest

from kvmesh.discovery.model import WORKER_ROLE_META
from kvmesh.rpc.channel import ChannelSecurity
from kvmesh.suite.admin import calls, render, target, views
from kvmesh.v1 import cache_manager_pb2, common_pb2, failover_pb2, planner_pb2, router_pb2


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
    reply.workers[0].endpoint.meta[WORKER_ROLE_META] = "prefill"  # a router names each worker's role
    return reply


def test_workers_document_and_table() -> None:
    doc = views.workers(_list_workers(), "r:1")
    assert [w["state"] for w in doc["workers"]] == ["passing", "draining"]
    assert doc["workers"][1]["circuit"] == "half_open" and doc["workers"][1]["selections_total"] == 13
    assert doc["workers"][0]["kv_blocks_total"] == 256
    assert [w["role"] for w in doc["workers"]] == ["prefill", ""]
    text = render.workers(doc)
    lines = text.splitlines()
    assert lines[0] == "router r:1  prefill weight 0.70  decode weight 0.30  workers 2"
    head = "WORKER ZONE ROLE STATE CIRCUIT RUN WAIT KV USE IN-FLIGHT SELECTED P95 MS HIT"
    assert lines[1].split() == head.split()
    row = ["w0", "a", "prefill", "passing", "closed", "2", "0", "25%", "64/256", "0", "3", "12.35", "50%"]
    assert lines[2].split() == row
    assert lines[3].split()[2:5] == ["-", "draining", "half_open"]  # no role known: a router that does not say
    assert all(line == line.rstrip() for line in lines)


def test_a_workers_role_comes_from_its_endpoint_meta() -> None:
    reply = _list_workers()
    reply.workers[1].endpoint.meta[WORKER_ROLE_META] = "decode"
    assert [w["role"] for w in views.workers(reply, "r:1")["workers"]] == ["prefill", "decode"]


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
    return views.zones(health, weights, "f:1", views.rotation([views.workers(_list_workers(), "r:1")]))


def test_zones_join_health_and_weights() -> None:
    doc = _zones_doc()
    assert [(z["zone"], z["weight"]) for z in doc["zones"]][:3] == [("a", 1.0), ("b", None), ("c", None)]  # type: ignore[attr-defined]
    assert doc["zones"][2]["rewarm_pending_from"] == ["a"]  # type: ignore[index]
    assert list(doc["version_weights"]) == ["v1", "v2"]  # type: ignore[call-overload]
    lines = render.zones(doc, now=1000.0).splitlines()
    assert lines[0] == "failover f:1  registry reachable"
    assert lines[2].split() == ["a", "healthy", "1.000", "1", "1", "2", "1", "1m", "-"]  # w1 of a is draining
    assert lines[3].split() == ["b", "UNHEALTHY", "-", "0", "0", "0", "-", "10s", "no", "router"]
    assert lines[4].split() == ["c", "re-warming", "-", "1", "1", "1", "-", "5s", "re-warm", "pending", "from", "a"]
    assert lines[5].split() == ["d", "STARTING", "-", "1", "0", "0", "-", "3s", "2", "of", "2", "workers", "loading"]
    assert lines[6] == "version weights: v1 0.900, v2 0.100"


def test_a_zone_whose_router_has_no_worker_in_rotation_is_unroutable_not_healthy() -> None:
    reply = _list_workers()
    reply.workers[0].draining = True  # w0 drained too (w1 already is)
    seen = [views.workers(reply, "r:1"), {"router": "r:2", "error": "cannot reach the router at r:2"}]
    assert views.rotation(seen) == {"a": {"routable": 0, "draining": 2, "workers": 2}}
    health = failover_pb2.GetZoneHealthResponse(registry_reachable=True)
    health.zones.add(zone="a", healthy=True, routers=1, cache_managers=1, workers=2, since=900.0)
    doc = views.zones(health, failover_pb2.TrafficWeights(zone_weights={"a": 1.0}), "f:1", views.rotation(seen))
    assert (doc["zones"][0]["routable"], doc["zones"][0]["draining"]) == (0, 2)  # type: ignore[index]
    row = render.zones(doc, now=1000.0).splitlines()[2].split()
    assert row[:2] == ["a", "UNROUTABLE"] and row[6] == "0" and " ".join(row[8:]) == "no worker in rotation: 2 draining"
    # an open circuit takes a worker out of rotation as a drain does; the router seeing most in rotation counts
    open_circuit = _list_workers()
    open_circuit.workers[0].circuit = "open"
    both = [views.workers(open_circuit, "r:1"), views.workers(_list_workers(), "r:3")]
    assert views.rotation(both)["a"]["routable"] == 1


def test_weights_text_is_the_split() -> None:
    doc = views.traffic_weights(failover_pb2.TrafficWeights(zone_weights={"b": 0.25, "a": 0.75}))
    lines = render.weights({"action": "set", **doc}).splitlines()
    assert lines[0] == "traffic weights set: zones a 75.0%, b 25.0%"
    assert lines[2:] == ["zone  a     0.750", "zone  b     0.250"]
    assert render.weights({"action": "rollback", **doc}).startswith("traffic weights rolled back: zones a 75.0%")
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
    stats.replication.add(zone="a", prefixes=3, blocks=12, bytes_total=4096, budget_bytes_per_s=5e7, pending=True)
    doc = views.index(stats, policy, "c:1")
    assert doc["replication"][0]["budget_bytes_per_s"] == 5e7 and doc["replication"][0]["pending"] is True
    lines = render.index(doc).splitlines()
    at = lines.index("hot prefixes replicated from zone b:")
    assert lines[at + 2].split() == ["a", "3", "12", "4096", "0", "50", "yes"]


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
    for var in ("ROUTER", "FAILOVER", "CACHE_MANAGER", "PLANNER", "ZONE", "TOKEN", "TOKEN_FILE", "API_KEY", "CA"):
        monkeypatch.delenv(f"KVMESH_{var}", raising=False)
    for var in ("CERT", "KEY"):
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


def _two_zone_suite(home: Path) -> None:
    (home / "run").mkdir(parents=True)
    (home / "run" / "admin.token").write_text("admin-secret\n")
    auth = {"tokens": {"admin": str(home / "run" / "admin.token")}, "tls": None}
    services = [
        {"name": name, "grpc": f"127.0.0.1:{port}", "zone": zone}
        for zone, base in (("a", 10), ("b", 20))
        for name, port in (("router", base), ("failover", base + 1), ("planner", base + 2))
    ]
    import json

    (home / "run" / "suite.json").write_text(json.dumps({"services": services, "auth": auth}))


def test_zone_picks_the_suite_s_service_of_that_zone(no_env: Path) -> None:
    _two_zone_suite(no_env)
    first = target.resolve(_args(), "router")
    assert first is not None and first.address == "127.0.0.1:10"  # no --zone: the first zone's
    b = target.resolve(_args(zone="b"), "planner")
    assert b is not None and b.address == "127.0.0.1:22" and b.security.token == "admin-secret"
    assert [t.address for t in target.resolve_all(_args(), "router")] == ["127.0.0.1:10", "127.0.0.1:20"]
    assert [t.address for t in target.resolve_all(_args(zone="b"), "router")] == ["127.0.0.1:20"]
    with pytest.raises(target.AdminError, match=r"--zone c: the suite in .* has no zone 'c' \(its zones: a, b\)") as e:
        target.resolve(_args(zone="c"), "router")
    assert e.value.exit_code == target.EXIT_USAGE


def test_an_address_given_by_hand_that_is_the_suite_s_gets_its_credential(no_env: Path) -> None:
    """The zone-b router named by flag is the running suite's own: it gets the operator's token (and a flag's
    credential still wins); any other address gets none."""
    _two_zone_suite(no_env)
    own = target.resolve(_args(router="127.0.0.1:20"), "router")
    assert own is not None and own.source == "flag" and own.security == ChannelSecurity(token="admin-secret")
    flagged = target.resolve(_args(router="127.0.0.1:20", token="other"), "router")
    assert flagged is not None and flagged.security.token == "other"
    foreign = target.resolve(_args(router="127.0.0.1:99"), "router")
    assert foreign is not None and foreign.security == ChannelSecurity()


def test_the_unauthenticated_hint_names_flags_the_command_has(no_env: Path) -> None:
    _two_zone_suite(no_env)
    t = target.Target("router", "r:1", ChannelSecurity(), "flag")
    text = str(calls.explain(_Err(grpc.StatusCode.UNAUTHENTICATED, "why"), t, "M"))
    assert f"--token-file FILE or --token TOKEN (the local suite's: --token-file {no_env}/run/admin.token)" in text
    assert "--api-key" not in text  # behind the suite's authorisation table an admin API key is refused
    parser = argparse.ArgumentParser()
    target.add_arguments(parser)
    have = {o for action in parser._actions for o in action.option_strings}
    named = {f for w in text.split() if w.startswith("--") for f in w.strip(",()").split("/")}
    assert named and named <= have, named - have


def test_planner_document_and_text() -> None:
    reply = planner_pb2.GetPlanResponse(actuator="dry-run", interval_s=60)
    z = reply.zones.add(zone="a", forecaster="moving_average", bucket_s=300, history_buckets=4, forecast=[3.0, 4.5])
    z.last.CopyFrom(
        planner_pb2.PlannerDecision(
            at=940, desired=2, serving=1, forecast_rps=0.015, add=1, reason="forecast needs 2, have 1"
        )
    )
    z.decisions.add(at=900, desired=2, serving=1, add=1, reason="forecast needs 2, have 1")
    reply.zones.add(zone="b", forecaster="moving_average", bucket_s=300, error="Unavailable: router down")
    doc = views.plan(reply, "p:1")
    assert doc["zones"][0]["last"]["add"] == 1 and doc["zones"][1]["last"] is None
    lines = render.plan(doc, now=1000.0).splitlines()
    assert lines[0] == "planner p:1  actuator dry-run  step every 60s"
    assert lines[1].startswith("zone a: forecaster moving_average (held-out MAE: none yet")
    assert lines[2] == (
        "  1m ago: 1 serving, 0 starting, 0 queued; sized for 0.015 req/s -> desired 2: "
        "add 1 (forecast needs 2, have 1)"
    )
    assert lines[3] == "  forecast, requests per 300s bucket: 3.0 4.5"
    assert lines[5].split()[:6] == ["1m", "2", "1", "0", "0", "add"]
    assert lines[-2:] == ["  last step failed: Unavailable: router down", "  no planning step yet"]


def test_guardrails_and_warming_text() -> None:
    on = views.guardrails(router_pb2.GuardrailsState(enabled=True, path="/g.yaml", rules=3, version=2, loaded_at=990))
    assert render.guardrails({"router": "r:1", **on, "changed": True}, now=1000.0) == (
        "router r:1: reloaded: new rules in force; 3 guardrail rules from /g.yaml (version 2, loaded 10s ago)"
    )
    off = {"router": "r:1", **views.guardrails(router_pb2.GuardrailsState())}
    assert "no guardrails" in render.guardrails(off, now=1000.0)
    policy = views.warming_policy(cache_manager_pb2.WarmingPolicy(hot_threshold=9, window_s=60, max_replicas=4))
    assert render.warming({"cache_manager": "c:1", "action": "set", **policy}).startswith(
        "warming policy set (cache-manager c:1): hot at 9 hits in 60s, up to 4 replicas"
    )


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
