"""`kvmesh-router --processes N`: N real router processes behind one gRPC and one HTTP port (SO_REUSEPORT),
supervised by one parent (kvmesh.rpc.processes), over simulated workers on loopback."""

from __future__ import annotations

import collections
import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from functools import partial
from pathlib import Path
from typing import Any

import grpc
import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from kvmesh.core.ports import free_port
from kvmesh.suite.launcher import SERVICES, ServiceProcess
from kvmesh.suite.observe import gone
from kvmesh.v1 import common_pb2, router_pb2, router_pb2_grpc
from tests.integration.router.test_e2e import _wait_for_holder
from tests.support.procs import start_together

pytestmark = pytest.mark.integration
BS = 32


def workers(services: Callable[..., ServiceProcess], n: int, *extra: str) -> list[ServiceProcess]:
    sim = ("--engine", "sim", "--block-size", str(BS), "--kv-blocks", "8192", *extra)
    return start_together(*[partial(services, "worker", *sim)] * n)


def routed_by_process(router: ServiceProcess) -> dict[int, float]:
    """pid -> requests that process routed, from each process's own /metrics port."""
    out = {}
    for p in json.loads(router.ready_file.read_text())["processes"]:
        text = httpx.get(f"http://127.0.0.1:{p['process_http_port']}/metrics", timeout=10).text
        lines = [ln for ln in text.splitlines() if ln.startswith("kvmesh_router_selections_total{")]
        out[p["pid"]] = sum(float(ln.rsplit(" ", 1)[1]) for ln in lines)
    return out


def complete(router: ServiceProcess, prompt: list[int]) -> dict[str, Any]:
    # a fresh connection per request: the kernel picks the process per connection
    with httpx.Client(base_url=f"http://127.0.0.1:{router.http_port}", timeout=30) as c:
        r = c.post("/v1/completions", json={"prompt": prompt, "max_tokens": 2})
    assert r.status_code == 200, r.text
    return dict(r.json())


def generate(
    router: ServiceProcess, prompt: list[int], max_tokens: int = 2
) -> router_pb2.RouterServiceGenerateResponse:
    req = router_pb2.RouterServiceGenerateRequest(
        token_ids=common_pb2.TokenIds(ids=prompt),
        sampling=common_pb2.SamplingParams(max_tokens=max_tokens, ignore_eos=True),
    )
    # its own subchannel pool: a fresh connection per call (the global pool may hand back a closing channel's
    # connection, and with it the same process every time)
    with grpc.insecure_channel(router.address, options=[("grpc.use_local_subchannel_pool", 1)]) as ch:
        return list(router_pb2_grpc.RouterServiceStub(ch).Generate(req, timeout=60))[-1]


def test_processes_share_both_ports_and_each_serves(services: Callable[..., ServiceProcess]) -> None:
    ws = workers(services, 2, "--sim-speed", "0")
    router = services(
        "router", "--workers", ",".join(w.address for w in ws), "--block-size", str(BS), "--processes", "2"
    )
    listed = json.loads(router.ready_file.read_text())["processes"]
    assert len({p["pid"] for p in listed}) == 2 and len({p["process_http_port"] for p in listed}) == 2
    for i in range(30):
        assert complete(router, [3 + i] * 40)["usage"]["completion_tokens"] == 2
        assert generate(router, [5 + i] * 40).usage.completion_tokens == 2
    routed = routed_by_process(router)
    assert sum(routed.values()) == 60
    assert all(n > 0 for n in routed.values()), routed  # 60 connections, 2 processes: all on one is 2^-59


def test_a_first_metrics_port_gives_process_i_that_port_plus_i(services: Callable[..., ServiceProcess]) -> None:
    # fixed per-process ports are what a pod declares (the Helm chart's router.processMetricsPort)
    ws = workers(services, 1, "--sim-speed", "0")
    first = free_port(consecutive=2)
    router = services(
        "router", "--workers", ws[0].address, "--block-size", str(BS), "--processes", "2",
        "--process-http-port", str(first),
    )  # fmt: skip
    listed = json.loads(router.ready_file.read_text())["processes"]
    assert sorted(p["process_http_port"] for p in listed) == [first, first + 1]
    for i in range(8):
        assert complete(router, [3 + i] * 40)["usage"]["completion_tokens"] == 2
    assert sum(routed_by_process(router).values()) == 8  # each port is one process's own metrics


def test_an_unknown_event_loop_stops_the_router_naming_it() -> None:
    cmd = [sys.executable, "-m", SERVICES["router"], "--port", "0", "--event-loop", "trio"]
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=60)
    assert out.returncode == 2 and "event_loop must be one of asyncio, uvloop, got 'trio'" in out.stderr, out.stderr


def test_a_bad_shared_index_role_stops_the_router_naming_it() -> None:
    cmd = [sys.executable, "-m", SERVICES["router"], "--port", "0", "--shared-index-role", "boss"]
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=60)
    assert out.returncode == 2 and "--shared-index-role: writer or reader, got 'boss'" in out.stderr, out.stderr


def test_a_router_on_uvloop_serves_both_apis(services: Callable[..., ServiceProcess]) -> None:
    ws = workers(services, 1, "--sim-speed", "0")
    router = services("router", "--workers", ws[0].address, "--block-size", str(BS), "--event-loop", "uvloop")
    assert complete(router, [3] * 40)["usage"]["completion_tokens"] == 2
    assert generate(router, [5] * 40).usage.completion_tokens == 2
    maps = Path(f"/proc/{router.proc.pid}/maps").read_text()
    assert "uvloop" in maps  # its loop is loaded: imported only when asked for


def test_a_killed_process_is_replaced_while_the_others_serve(services: Callable[..., ServiceProcess]) -> None:
    ws = workers(services, 1, "--sim-speed", "0")
    router = services("router", "--workers", ws[0].address, "--block-size", str(BS), "--processes", "2")
    victim = json.loads(router.ready_file.read_text())["processes"][0]["pid"]
    os.kill(victim, signal.SIGKILL)
    deadline = time.monotonic() + 60
    while not gone(victim):  # bounded: a connection queued on its socket as it dies is reset
        assert time.monotonic() < deadline
        time.sleep(0.01)
    for i in range(10):  # the survivor takes every new connection meanwhile
        assert complete(router, [7 + i] * 40)["usage"]["completion_tokens"] == 2
    while True:  # bounded poll: the supervisor rewrites its ready file once the replacement serves
        pids = {p["pid"] for p in json.loads(router.ready_file.read_text())["processes"]}
        if victim not in pids and len(pids) == 2:
            break
        assert time.monotonic() < deadline, pids
        time.sleep(0.05)
    assert all(n >= 0 for n in routed_by_process(router).values())  # every listed process answers its port
    assert router.terminate(timeout=30) == 0
    for pid in pids:  # SIGTERM to the supervisor stops every process it started
        with pytest.raises(ProcessLookupError):
            os.kill(pid, 0)


def test_two_processes_of_two_replicas_do_not_herd_a_shared_system_prompt(
    services: Callable[..., ServiceProcess],
) -> None:
    """Two routers of two processes each, over four workers: every request is one 2048-token system prompt
    plus its own 64 tokens, 16 at a time. Workers report their load every 10 s, so in the burst each process
    knows the load only from its own in-flight accounting (scaled for 2 replicas × 2 processes): the worker
    that first holds the prompt must not take the requests of all four."""
    cm = services("cache-manager", "--block-size", str(BS))
    ws = workers(services, 4, "--sim-speed", "1", "--cache-manager", cm.address)
    flags = ["--workers", ",".join(w.address for w in ws), "--block-size", str(BS), "--cache-manager", cm.address]
    flags += ["--load-interval-ms", "10000", "--worker-stale-s", "60"]  # no load report in the burst
    routers = start_together(*[partial(services, "router", *flags, "--processes", "2", "--router-replicas", "2")] * 2)
    system = [(i % 1000) + 3 for i in range(2048)]
    prompts = [system + [(7 * i + k) % 1000 + 3 for k in range(64)] for i in range(48)]
    with ThreadPoolExecutor(16) as pool:
        served = list(pool.map(lambda ip: generate(routers[ip[0] % 2], ip[1], 16).worker_id, enumerate(prompts)))
    per_worker = collections.Counter(served)
    assert len(per_worker) == 4, per_worker
    assert max(per_worker.values()) <= len(prompts) // 2, per_worker


def lookups_by_process(router: ServiceProcess) -> list[dict[str, float]]:
    """Per process, in process order: its index lookups by what answered them (its own /metrics)."""
    out = []
    for p in json.loads(router.ready_file.read_text())["processes"]:
        text = httpx.get(f"http://127.0.0.1:{p['process_http_port']}/metrics", timeout=10).text
        by = {}
        for fam in text_string_to_metric_families(text):
            for s in fam.samples:
                if s.name == "kvmesh_router_index_lookups_total":
                    by[s.labels["source"]] = s.value
        out.append(by)
    return out


def shared_files(router: ServiceProcess) -> list[str]:
    prefix = f"kvmesh-router-{router.proc.pid}-index"
    return [f for f in os.listdir("/dev/shm") if f.startswith(prefix)]


def two_processes_on_a_cache_manager(services: Callable[..., ServiceProcess]) -> tuple[ServiceProcess, ServiceProcess]:
    """(cache-manager, router of 2 processes) over 2 instant sim workers that report to that cache-manager."""
    cm = services("cache-manager", "--block-size", str(BS))
    ws = workers(services, 2, "--sim-speed", "0", "--cache-manager", cm.address)
    router = services(
        "router", "--workers", ",".join(w.address for w in ws), "--block-size", str(BS),
        "--cache-manager", cm.address, "--processes", "2",
    )  # fmt: skip
    return cm, router


def test_processes_share_one_index_replica_that_one_of_them_follows(services: Callable[..., ServiceProcess]) -> None:
    cm, router = two_processes_on_a_cache_manager(services)
    cm_metrics = httpx.get(f"http://127.0.0.1:{cm.http_port}/metrics", timeout=10).text.splitlines()
    assert "kvmesh_cache_watchers 1.0" in cm_metrics  # one WatchIndex stream for both processes
    assert f"kvmesh-router-{router.proc.pid}-index" in shared_files(router)
    # 20 requests in a row, each on a fresh connection (so both processes route), all to the worker holding
    # their prompt once the cache-manager has indexed it. A request routed before the routers' copies had the
    # blocks puts the prompt on the other worker too (a tie from then on): the streak restarts on a new prompt.
    deadline, streak, rounds, seen = time.monotonic() + 120, 0, 0, collections.Counter[tuple[bool, bool]]()
    while streak < 20:
        assert time.monotonic() < deadline, (rounds, seen, lookups_by_process(router))
        if streak == 0:
            prompt = [(i % 500) + 3 + rounds for i in range(8 * BS)]
            rounds += 1
            holder = generate(router, prompt).worker_id
            _wait_for_holder(cm.address, prompt, holder, blocks=8, model="")
        resp = generate(router, prompt)
        seen[resp.worker_id == holder, resp.usage.cached_tokens > 0] += 1
        streak = streak + 1 if resp.worker_id == holder and resp.usage.cached_tokens > 0 else 0
    writer, reader = lookups_by_process(router)
    assert writer.get("replica", 0) > 0 and writer.get("shared", 0) == 0, writer
    assert reader.get("shared", 0) > 0 and reader.get("replica", 0) == 0, reader
    assert router.terminate(timeout=30) == 0
    assert shared_files(router) == []  # the supervisor removes them


def test_a_killed_writer_is_replaced_and_readers_read_its_successor(services: Callable[..., ServiceProcess]) -> None:
    _, router = two_processes_on_a_cache_manager(services)
    writer_pid = json.loads(router.ready_file.read_text())["processes"][0]["pid"]
    os.kill(writer_pid, signal.SIGKILL)
    deadline = time.monotonic() + 60
    while not gone(writer_pid):  # bounded: a connection queued on its socket as it dies is reset
        assert time.monotonic() < deadline
        time.sleep(0.01)
    for i in range(10):  # the reader serves every new connection meanwhile (FindMatches once the copy is stale)
        assert generate(router, [9 + i] * 40).usage.completion_tokens == 2
    while True:  # bounded poll: the supervisor lists the replacement once it serves
        listed = json.loads(router.ready_file.read_text())["processes"]
        if listed[0]["pid"] != writer_pid:
            break
        assert time.monotonic() < deadline, listed
        time.sleep(0.05)
    before = lookups_by_process(router)[1].get("shared", 0)
    while lookups_by_process(router)[1].get("shared", 0) <= before:  # the reader reads the new writer's copy
        assert time.monotonic() < deadline
        generate(router, [11] * 40)
