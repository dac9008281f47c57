"""`kvmesh up` / `status` / `demo` / `down`: the whole suite as separate real processes on loopback."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import stat
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Callable
from pathlib import Path
from typing import Any

import grpc
import pytest

from kvmesh.client import Client
from kvmesh.rpc.channel import ChannelSecurity
from kvmesh.rpc.tls import client_ssl_context
from kvmesh.suite.observe import gone
from kvmesh.v1 import (
    cache_manager_pb2,
    cache_manager_pb2_grpc,
    common_pb2,
    failover_pb2,
    failover_pb2_grpc,
    router_pb2,
    router_pb2_grpc,
    worker_pb2,
    worker_pb2_grpc,
)
from tests.support.cli import kvmesh_cli
from tests.support.poll import wait_until
from tests.support.scrape import metric

pytestmark = [pytest.mark.integration]


def _pids(home: Path) -> list[int]:
    state = json.loads((home / "run" / "suite.json").read_text())
    return [int(s["pid"]) for s in state["services"]]


def _address(state: dict[str, Any], name: str) -> str:
    return str(next(s["grpc"] for s in state["services"] if s["name"] == name))


def _channel(address: str, creds: grpc.ChannelCredentials | None = None) -> grpc.Channel:
    return grpc.secure_channel(address, creds) if creds else grpc.insecure_channel(address)


def _served_through_failover(
    home: Path, creds: grpc.ChannelCredentials | None = None, security: ChannelSecurity | None = None
) -> None:
    """The suite's failover service finds the router in the registry `kvmesh up` wrote, and `kvmesh.client`
    pointed only at the failover service serves a request through it."""
    state = json.loads((home / "run" / "suite.json").read_text())
    failover = _address(state, "failover")
    router = _address(state, "router")
    seen: list[tuple[str, bool, list[str]]] = []
    with _channel(failover, creds) as ch:
        # each message is a new revision of the endpoint sets; the zone turns healthy after its hysteresis
        stream = failover_pb2_grpc.FailoverServiceStub(ch).WatchEndpoints(
            failover_pb2.WatchEndpointsRequest(), timeout=30
        )
        for resp in stream:
            seen = [(z.zone, z.healthy, sorted(e.address for e in z.endpoints)) for z in resp.zones]
            if seen and seen[0][1]:
                break
        stream.cancel()
    assert len(seen) == 1 and seen[0][:2] == ("local", True), seen
    assert router in seen[0][2], seen
    req = router_pb2.RouterServiceGenerateRequest(
        token_ids=common_pb2.TokenIds(ids=list(range(3, 67))),
        sampling=common_pb2.SamplingParams(max_tokens=4, ignore_eos=True),
    )
    with Client([failover], timeout_s=60, security=security) as client:
        steps = list(client.generate(req))
    assert steps[-1].finish_reason and steps[-1].usage.completion_tokens == 4
    assert steps[-1].worker_id.startswith("worker-local-")


ROUTER_GONE_BOUND_S = 5.0  # probes: 3 failures 0.5 s apart, plus a phase and a loaded machine's slack


def _router_kill_is_seen(home: Path) -> float:
    """SIGKILL of the suite's router: the failover service's endpoint set drops it (health probes of the static
    registry) within `ROUTER_GONE_BOUND_S`; returns the seconds it took, from the kill to the revision."""
    state = json.loads((home / "run" / "suite.json").read_text())
    failover = next(s["grpc"] for s in state["services"] if s["name"] == "failover")
    router = next(s for s in state["services"] if s["name"] == "router")
    with grpc.insecure_channel(failover) as ch:
        stream = failover_pb2_grpc.FailoverServiceStub(ch).WatchEndpoints(
            failover_pb2.WatchEndpointsRequest(), timeout=30
        )
        first = next(stream)  # the current endpoint sets: the router is in them
        assert router["grpc"] in {e.address for z in first.zones for e in z.endpoints}, first
        os.kill(int(router["pid"]), signal.SIGKILL)
        killed = time.monotonic()
        took, last = None, first
        with contextlib.suppress(grpc.RpcError):  # the stream's deadline bounds the wait
            for resp in stream:
                last = resp
                if router["grpc"] not in {e.address for z in resp.zones for e in z.endpoints}:
                    took = time.monotonic() - killed
                    break
        stream.cancel()
    assert took is not None, f"killed router still in the endpoint sets: {last}"
    assert not last.zones[0].healthy, last  # a zone without a router cannot serve
    assert took <= ROUTER_GONE_BOUND_S, f"killed router dropped after {took:.2f}s"
    print(f"killed router dropped from the endpoint set after {took:.2f}s")
    return took


def _bearer(path: str) -> tuple[tuple[str, str]]:
    return (("authorization", "Bearer " + Path(path).read_text().strip()),)


def _code(call: Callable[[], object]) -> grpc.StatusCode:
    try:
        call()
    except grpc.RpcError as err:
        return err.code()  # type: ignore[no-any-return]
    return grpc.StatusCode.OK


def _internal_rpcs(state: dict[str, Any], channel: Callable[[str], grpc.Channel], metadata: Any = ()) -> dict[str, Any]:
    """The status of internal RPCs of the suite made on `channel`s, each an attack of the security review: KV events
    published (forged) and read, an index query, a checkpoint, free generation and an abort on a worker, a
    forged router registration, traffic weights, a drain."""
    cm, worker, router = (_address(state, n) for n in ("cache-manager", "worker", "router"))
    hello = cache_manager_pb2.WorkerHello(worker_id="worker-local-0", instance_id="forged", block_size=32)
    codes = {}
    with channel(cm) as ch:
        publish = cache_manager_pb2_grpc.CacheManagerServiceStub(ch).PublishKvEvents(
            iter([cache_manager_pb2.PublishKvEventsRequest(hello=hello)]), timeout=10, metadata=metadata
        )
        codes["PublishKvEvents"] = _code(lambda: list(publish))
        find = cache_manager_pb2_grpc.CacheManagerServiceStub(ch).FindMatches
        req = cache_manager_pb2.FindMatchesRequest(token_ids=common_pb2.TokenIds(ids=list(range(64))))
        codes["FindMatches"] = _code(lambda: find(req, timeout=10, metadata=metadata))
        checkpoint = cache_manager_pb2_grpc.CacheManagerServiceStub(ch).Checkpoint
        codes["Checkpoint"] = _code(
            lambda: checkpoint(cache_manager_pb2.CheckpointRequest(), timeout=10, metadata=metadata)
        )
    with channel(worker) as ch:
        stub = worker_pb2_grpc.WorkerServiceStub(ch)
        events = stub.StreamKvEvents(worker_pb2.StreamKvEventsRequest(), timeout=10, metadata=metadata)
        codes["StreamKvEvents"] = _code(lambda: next(events))
        prompt = worker_pb2.GenerateRequest(request_id="free", token_ids=common_pb2.TokenIds(ids=list(range(3, 40))))
        codes["WorkerGenerate"] = _code(lambda: list(stub.Generate(prompt, timeout=10, metadata=metadata)))
        abort = worker_pb2.AbortRequest(request_id="someone-else")
        codes["Abort"] = _code(lambda: stub.Abort(abort, timeout=10, metadata=metadata))
    with channel(_address(state, "failover")) as ch:
        fo = failover_pb2_grpc.FailoverServiceStub(ch)
        fake = failover_pb2.RegisterRequest(
            endpoint=common_pb2.Endpoint(id="evil", address="127.0.0.1:1", role=common_pb2.SERVICE_ROLE_ROUTER)
        )
        codes["Register"] = _code(lambda: fo.Register(fake, timeout=10, metadata=metadata))
        weights = failover_pb2.SetTrafficWeightsRequest()
        codes["SetTrafficWeights"] = _code(lambda: fo.SetTrafficWeights(weights, timeout=10, metadata=metadata))
    with channel(router) as ch:
        drain = router_pb2_grpc.RouterAdminServiceStub(ch).DrainWorker
        codes["DrainWorker"] = _code(
            lambda: drain(
                router_pb2.DrainWorkerRequest(worker_id="worker-local-0", drain=True), timeout=10, metadata=metadata
            )
        )
    return codes


def _tenant_is_bound(router: str, channel: grpc.Channel, metadata: Any = ()) -> None:
    """The demo client (its role token or its certificate) runs as its own tenant: declaring another is
    PERMISSION_DENIED naming it, declaring its own serves."""
    stub = router_pb2_grpc.RouterServiceStub(channel)

    def gen(tenant: str) -> list[router_pb2.RouterServiceGenerateResponse]:
        req = router_pb2.RouterServiceGenerateRequest(
            token_ids=common_pb2.TokenIds(ids=list(range(3, 40))),
            sampling=common_pb2.SamplingParams(max_tokens=1, ignore_eos=True),
            tenant=tenant,
        )
        return list(stub.Generate(req, timeout=30, metadata=metadata))

    with pytest.raises(grpc.RpcError) as err:
        gen("alice")
    assert err.value.code() == grpc.StatusCode.PERMISSION_DENIED, router
    assert "tenant 'alice' is not allowed for client 'demo'" in (err.value.details() or "")
    assert gen("demo")[-1].usage.completion_tokens == 1


def _all_but_publish(codes: dict[str, Any]) -> set[grpc.StatusCode]:
    """The codes of every internal RPC but PublishKvEvents (a worker's own; whether it may publish as the worker
    its hello names is the cache-manager's check)."""
    return {c for name, c in codes.items() if name != "PublishKvEvents"}


def _planner_sees_the_zone(home: Path) -> None:
    """The suite's planner (dry-run) reads its router with its own identity: both workers serving, and at
    least the 2 warm workers wanted."""
    state = json.loads((home / "run" / "suite.json").read_text())
    port = next(s["http_port"] for s in state["services"] if s["name"] == "planner")
    zone = 'zone="local"'
    wait_until(lambda: metric(port, "kvmesh_planner_serving_workers", zone) == 2, timeout_s=60)
    assert metric(port, "kvmesh_planner_desired_workers", zone) >= 2


def _least_privilege(home: Path) -> None:
    """A plain `kvmesh up` suite: an anonymous caller gets no internal RPC (no KV events published or read, no
    drain, no admin HTTP route); a worker's own identity does not make it an admin or an index reader; the
    provisioned token files are the user's alone."""
    state = json.loads((home / "run" / "suite.json").read_text())
    anonymous = _internal_rpcs(state, grpc.insecure_channel)
    assert set(anonymous.values()) == {grpc.StatusCode.UNAUTHENTICATED}, anonymous
    worker_token = home / "run" / "auth" / "worker-worker-local-0.token"
    as_worker = _internal_rpcs(state, grpc.insecure_channel, _bearer(str(worker_token)))
    assert _all_but_publish(as_worker) == {grpc.StatusCode.PERMISSION_DENIED}, as_worker
    router = next(s for s in state["services"] if s["name"] == "router")
    url = f"http://127.0.0.1:{router['http_port']}/admin/drain"
    req = urllib.request.Request(url, data=b'{"worker_id": "worker-local-0"}', method="POST")
    req.add_header("Content-Type", "application/json")
    with pytest.raises(urllib.error.HTTPError) as refused:
        urllib.request.urlopen(req, timeout=10)
    assert refused.value.code == 401
    with grpc.insecure_channel(router["grpc"]) as ch:  # the operator's provisioned token is an admin
        listed = router_pb2_grpc.RouterAdminServiceStub(ch).ListWorkers(
            router_pb2.ListWorkersRequest(), timeout=10, metadata=_bearer(state["auth"]["tokens"]["admin"])
        )
    assert len(listed.workers) == 2 and all(
        w.endpoint.health == common_pb2.HEALTH_STATE_PASSING for w in listed.workers
    )
    with grpc.insecure_channel(router["grpc"]) as ch:
        _tenant_is_bound(router["grpc"], ch, _bearer(state["auth"]["tokens"]["client"]))
    for path in (home / "run" / "auth").iterdir():
        assert stat.S_IMODE(path.stat().st_mode) == 0o600, path


def test_up_detach_status_demo_down(tmp_path: Path) -> None:
    home = tmp_path / "home"
    up = kvmesh_cli(home, "up", "--detach", "--ports", "auto", "--workers", "2", "--set", "planner.intervalS=1")
    assert up.returncode == 0, up.stdout + up.stderr
    try:
        pids = _pids(home)
        assert len(pids) == 6  # cache-manager, 2 workers, router, failover, planner
        status = kvmesh_cli(home, "status", timeout=60)
        assert status.returncode == 0, status.stdout
        assert status.stdout.count("SERVING") == 6
        _planner_sees_the_zone(home)
        demo = kvmesh_cli(home, "demo", "--max-tokens", "8", timeout=120)
        assert demo.returncode == 0, demo.stdout + demo.stderr
        assert "completion (worker-local-" in demo.stdout
        assert "completion=8" in demo.stdout
        _least_privilege(home)
        _served_through_failover(home)
        _router_kill_is_seen(home)
    finally:
        down = kvmesh_cli(home, "down", timeout=120)
    assert down.returncode == 0, down.stdout + down.stderr
    assert all(gone(p) for p in pids)
    assert kvmesh_cli(home, "status", timeout=30).returncode == 1


def test_up_foreground_stops_every_service_on_ctrl_c(tmp_path: Path) -> None:
    home = tmp_path / "home"
    env = {**os.environ, "KVMESH_HOME": str(home), "PYTHONUNBUFFERED": "1"}
    proc = subprocess.Popen(
        [sys.executable, "-m", "kvmesh.suite.cli", "up", "--ports", "auto", "--workers", "1"],
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    assert proc.stdout is not None
    seen = []
    for line in proc.stdout:  # bounded: the suite prints a fixed banner, then "press Ctrl-C"
        seen.append(line)
        if "press Ctrl-C" in line:
            break
        assert len(seen) < 200, "".join(seen)
    pids = _pids(home)
    try:
        proc.send_signal(signal.SIGINT)
        out, _ = proc.communicate(timeout=120)
        assert proc.returncode == 0, "".join(seen) + out
        assert "suite stopped" in out
        assert all(gone(p) for p in pids)
    finally:  # never leave a suite behind, whatever failed
        for pid in [*pids, proc.pid]:
            if not gone(pid):
                os.kill(pid, signal.SIGKILL)


def _admin_cli_over_mtls(home: Path, state: dict[str, Any], pki: Path) -> None:
    """The admin CLI on a `--tls` suite: by default with the suite's operator certificate; as a remote target
    with the admin pair by flags; the demo client's pair is denied (exit 3)."""
    local = kvmesh_cli(home, "workers", "--json", timeout=60)
    assert local.returncode == 0, local.stdout + local.stderr
    assert len(json.loads(local.stdout)["workers"]) == 1
    router = _address(state, "router")

    def remote(stem: str) -> subprocess.CompletedProcess[str]:
        pair = ("--cert", str(pki / f"{stem}.pem"), "--key", str(pki / f"{stem}.key"))
        return kvmesh_cli(home, "workers", "--json", "--router", router, "--ca", str(pki / "ca.pem"), *pair)

    admin = next(p.stem for p in pki.glob("admin-*.pem"))
    as_admin = remote(admin)
    assert as_admin.returncode == 0 and json.loads(as_admin.stdout)["workers"], as_admin.stdout + as_admin.stderr
    as_client = remote("client-demo")
    assert as_client.returncode == 3 and "needs role admin" in as_client.stderr, as_client.stdout + as_client.stderr


def _http_is_tls_only(state: dict[str, Any], up_stdout: str) -> None:
    """The router's OpenAI API and admin routes over HTTPS verified with the suite's CA, as `up` prints its URL;
    a plaintext request to that port, even with the operator's token, is never served."""
    router = next(s for s in state["services"] if s["name"] == "router")
    address = f"127.0.0.1:{router['http_port']}"
    assert f"OpenAI API     https://{address}/v1" in up_stdout, up_stdout
    admin = {"Authorization": _bearer(state["auth"]["tokens"]["admin"])[0][1]}
    req = urllib.request.Request(f"https://{address}/admin/workers", headers=admin)
    with urllib.request.urlopen(req, timeout=10, context=client_ssl_context(state["auth"]["tls"]["ca"])) as reply:
        assert reply.status == 200 and "prefill_weight" in json.loads(reply.read())
    plain = urllib.request.Request(f"http://{address}/admin/workers", headers=admin)
    with pytest.raises((urllib.error.URLError, ConnectionError)):  # the TLS port closes on plaintext
        urllib.request.urlopen(plain, timeout=10)


def test_up_tls_runs_every_connection_over_mtls_with_the_table(tmp_path: Path) -> None:
    """`kvmesh up --tls`: the suite serves (status, demo, kvmesh.client through the failover service) with
    identities from its development CA; a plaintext caller gets nothing, and a worker's certificate neither
    reads the index nor drains; the HTTP API is HTTPS only."""
    home = tmp_path / "home"
    up = kvmesh_cli(home, "up", "--detach", "--ports", "auto", "--workers", "1", "--tls")
    assert up.returncode == 0, up.stdout + up.stderr
    try:
        state = json.loads((home / "run" / "suite.json").read_text())
        tls = state["auth"]["tls"]
        status = kvmesh_cli(home, "status", timeout=60)
        assert status.returncode == 0 and status.stdout.count("SERVING") == 5, status.stdout
        demo = kvmesh_cli(home, "demo", "--max-tokens", "4", timeout=120)
        assert demo.returncode == 0 and "completion=4" in demo.stdout, demo.stdout + demo.stderr
        assert "OpenAI API https://127.0.0.1:" in demo.stdout, demo.stdout  # its HTTP call, with the suite CA
        _http_is_tls_only(state, up.stdout)
        pki = home / "run" / "pki"

        def creds(stem: str) -> grpc.ChannelCredentials:
            return grpc.ssl_channel_credentials(
                (pki / "ca.pem").read_bytes(), (pki / f"{stem}.key").read_bytes(), (pki / f"{stem}.pem").read_bytes()
            )

        plaintext = _internal_rpcs(state, grpc.insecure_channel)
        assert set(plaintext.values()) == {grpc.StatusCode.UNAVAILABLE}, plaintext  # TLS only: no handshake
        as_worker = _internal_rpcs(state, lambda a: grpc.secure_channel(a, creds("worker-worker-local-0")))
        assert _all_but_publish(as_worker) == {grpc.StatusCode.PERMISSION_DENIED}, as_worker
        with grpc.secure_channel(_address(state, "router"), creds("client-demo")) as ch:
            _tenant_is_bound(_address(state, "router"), ch)
        client = ChannelSecurity(tls["ca"], *tls["client"])
        _served_through_failover(home, creds("client-demo"), client)
        _admin_cli_over_mtls(home, state, pki)
    finally:
        down = kvmesh_cli(home, "down", timeout=120)
    assert down.returncode == 0, down.stdout + down.stderr
