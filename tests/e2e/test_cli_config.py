"""`kvmesh up --config`: a bad file and a port in use stop it before anything starts; the two-zone vLLM example
of docs/examples starts two zones of real vLLM workers that both answer an OpenAI request."""

from __future__ import annotations

import json
import socket
import urllib.request
from pathlib import Path
from typing import Any

import grpc
import pytest

from kvmesh.core.ports import free_port
from kvmesh.v1 import cache_manager_pb2, cache_manager_pb2_grpc, failover_pb2, failover_pb2_grpc
from tests.support.cli import kvmesh_cli
from tests.support.poll import wait_until

pytestmark = [pytest.mark.integration]

EXAMPLES = Path(__file__).resolve().parents[2] / "docs" / "examples"
PORT_KEYS = {  # every fixed port of a one-zone, one-worker suite
    "router": ("grpcPort", "httpPort"),
    "cacheManager": ("grpcPort", "httpPort"),
    "failover": ("grpcPort", "httpPort"),
    "worker": ("grpcPort", "httpPort", "kvSyncPort"),
    "planner": ("grpcPort", "httpPort"),
}


def test_a_bad_file_is_an_error_naming_the_key(tmp_path: Path) -> None:
    f = tmp_path / "k.yaml"
    f.write_text("zones:\n  - name: a\n  - name: b\n    worker: {replicas: two}\n")
    out = kvmesh_cli(tmp_path / "home", "up", "--config", str(f), timeout=60)
    assert out.returncode == 2, out.stdout + out.stderr
    assert f"{f}: zones[1].worker.replicas: expected int, got str 'two'" in out.stderr
    assert not (tmp_path / "home" / "run").exists()


def test_a_port_in_use_stops_up_before_anything_starts(tmp_path: Path) -> None:
    """Fixed ports (free ones the test picks), the router's HTTP port held by a listening socket: `up` names it
    and the flag that moves it, and leaves nothing behind (no process, no state, no provisioned identity)."""
    ports = iter([free_port() for _ in range(sum(len(k) for k in PORT_KEYS.values()))])
    sets = [f"{section}.{key}={next(ports)}" for section, keys in PORT_KEYS.items() for key in keys]
    busy_port = int(sets[1].split("=")[1])  # router.httpPort
    home = tmp_path / "home"
    with socket.socket() as busy:
        busy.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        busy.bind(("127.0.0.1", busy_port))
        busy.listen()
        args = [x for s in sets for x in ("--set", s)]
        out = kvmesh_cli(home, "up", "--detach", "--workers", "1", *args, timeout=60)
    assert out.returncode == 1, out.stdout + out.stderr
    assert f"port {busy_port} is in use (router HTTP (OpenAI API, /metrics) of zone local, router.httpPort)" in (
        out.stderr
    )
    assert "--http-port PORT" in out.stderr and "--ports auto" in out.stderr
    assert out.stderr.count("is in use") == 1  # only that port
    run = home / "run"
    assert not (run / "suite.json").exists() and not (run / "auth").exists() and not (run / "logs").exists()


def test_a_prometheus_port_in_use_stops_up_before_anything_starts(tmp_path: Path) -> None:
    home = tmp_path / "home"
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        out = kvmesh_cli(home, "up", "--detach", "--ports", "auto", "--observe", "--prometheus-port", str(port))
    assert out.returncode == 1, out.stdout + out.stderr
    assert f"nothing started: --observe: port {port} for Prometheus is in use (--prometheus-port)" in out.stderr
    run = home / "run"
    assert not (run / "suite.json").exists() and not (run / "auth").exists() and not (run / "logs").exists()


def _chat(http_port: int) -> dict[str, Any]:
    body = json.dumps({"messages": [{"role": "user", "content": "Hello!"}], "max_tokens": 4}).encode()
    req = urllib.request.Request(f"http://127.0.0.1:{http_port}/v1/chat/completions", data=body, method="POST")
    req.add_header("Content-Type", "application/json")
    with urllib.request.urlopen(req, timeout=120) as resp:
        return json.loads(resp.read())  # type: ignore[no-any-return]


def _zones_healthy(failover: str, creds: grpc.ChannelCredentials | None = None) -> list[tuple[str, bool, int]]:
    """The failover service's endpoint sets until both zones are healthy (the stream's deadline bounds it)."""
    seen: list[tuple[str, bool, int]] = []
    with grpc.secure_channel(failover, creds) if creds else grpc.insecure_channel(failover) as ch:
        stream = failover_pb2_grpc.FailoverServiceStub(ch).WatchEndpoints(
            failover_pb2.WatchEndpointsRequest(), timeout=60
        )
        for resp in stream:
            seen = [(z.zone, z.healthy, len(z.endpoints)) for z in resp.zones]
            if len(seen) == 2 and all(h for _, h, _ in seen):
                break
        stream.cancel()
    return seen


def _follows(cache_manager: str, creds: grpc.ChannelCredentials, zone: str) -> bool:
    """The cache-manager follows `zone`, connected, and replicates into it."""
    with grpc.secure_channel(cache_manager, creds) as ch:
        r = cache_manager_pb2_grpc.CacheManagerServiceStub(ch).GetStats(cache_manager_pb2.GetStatsRequest(), timeout=10)
    followed = [(z.zone, z.connected) for z in r.followed_zones]
    return followed == [(zone, True)] and [t.zone for t in r.replication] == [zone]


def _by_zone(home: Path) -> dict[str, dict[str, list[dict[str, Any]]]]:
    state = json.loads((home / "run" / "suite.json").read_text())
    by_zone: dict[str, dict[str, list[dict[str, Any]]]] = {}
    for s in state["services"]:
        by_zone.setdefault(s["zone"], {}).setdefault(s["name"], []).append(s)
    return by_zone


def test_two_zones_from_a_file_with_flags_tls_and_redis(tmp_path: Path) -> None:
    """Two sim zones (zone b with its own worker count) under one CA and one set of identities, checkpoints in
    one redis-server, zone b's router two processes: every service serves, the demo answers, each failover
    service sees both zones, each cache-manager follows the other zone and replicates into it."""
    f = tmp_path / "k.yaml"
    f.write_text(
        "worker: {replicas: 1}\nzones:\n  - name: a\n"
        "  - name: b\n    worker: {replicas: 2}\n    router: {processes: 2}\n"
    )
    home = tmp_path / "home"
    up = kvmesh_cli(home, "up", "--config", str(f), "--ports", "auto", "--tls", "--redis", "--detach", timeout=240)
    assert up.returncode == 0, up.stdout + up.stderr
    try:
        by_zone = _by_zone(home)
        assert [w["id"] for w in by_zone["b"]["worker"]] == ["worker-b-0", "worker-b-1"]
        assert len(by_zone["a"]["worker"]) == 1
        assert len(by_zone["b"]["router"][0]["processes"]) == 2 and "processes" not in by_zone["a"]["router"][0]
        status = kvmesh_cli(home, "status", timeout=60)
        assert status.returncode == 0 and status.stdout.count("SERVING") == 11, status.stdout
        demo = kvmesh_cli(home, "demo", "--max-tokens", "3", timeout=120)
        assert demo.returncode == 0 and "completion=3" in demo.stdout, demo.stdout + demo.stderr
        pki = home / "run" / "pki"
        creds = grpc.ssl_channel_credentials(
            (pki / "ca.pem").read_bytes(),
            (pki / "admin-operator.key").read_bytes(),
            (pki / "admin-operator.pem").read_bytes(),
        )
        for zone in ("a", "b"):
            seen = _zones_healthy(by_zone[zone]["failover"][0]["grpc"], creds)
            assert [(z, h) for z, h, _ in seen] == [("a", True), ("b", True)], (zone, seen)
        # active-active: each cache-manager follows the other zone (TLS, its own identity) and replicates into it
        for zone, other in (("a", "b"), ("b", "a")):
            cm = by_zone[zone]["cache-manager"][0]["grpc"]
            wait_until(lambda cm=cm, other=other: _follows(cm, creds, other), timeout_s=60)
    finally:
        down = kvmesh_cli(home, "down", timeout=120)
    assert down.returncode == 0, down.stdout + down.stderr


@pytest.mark.vllm
@pytest.mark.slow
@pytest.mark.timeout(900)  # two vLLM engines start together (about 2 min on 2 shared cores)
def test_two_zone_vllm_example_serves_in_both_zones(tmp_path: Path) -> None:
    home = tmp_path / "home"
    example = EXAMPLES / "kvmesh-two-zones-vllm.yaml"
    up = kvmesh_cli(home, "up", "--config", str(example), "--ports", "auto", "--detach", timeout=720)
    assert up.returncode == 0, up.stdout + up.stderr
    try:
        by_zone = _by_zone(home)
        assert sorted(by_zone) == ["zone-a", "zone-b"]
        for zone, services in by_zone.items():
            assert {n: len(v) for n, v in services.items()} == {
                "cache-manager": 1,
                "worker": 1,
                "router": 1,
                "failover": 1,
                "planner": 1,
            }, zone
            assert services["worker"][0]["id"] == f"worker-{zone}-0"
            reply = _chat(services["router"][0]["http_port"])
            assert reply["usage"]["completion_tokens"] == 4 and reply["model"] == "tiny-llama", reply
        status = kvmesh_cli(home, "status", timeout=60)
        assert status.returncode == 0 and status.stdout.count("SERVING") == 10, status.stdout
        seen = _zones_healthy(by_zone["zone-b"]["failover"][0]["grpc"])
        assert [(z, h) for z, h, _ in seen] == [("zone-a", True), ("zone-b", True)], seen
    finally:
        down = kvmesh_cli(home, "down", timeout=180)
    assert down.returncode == 0, down.stdout + down.stderr
