"""The planner scales a local suite out under a 10x burst and back in, losing no request: real failover,
cache-manager, router, sim workers and `kvmesh-planner` (local actuator) processes on 127.0.0.1.

Two workers are in the static registry from the start (the planner may not stop them: it stops only what it
started). The load is 2 req/s, then 20 req/s until a worker the planner started has served part of the
burst, then 2 req/s again until the planner's workers are gone. The planner's time scales are shortened (1 s
buckets, a 3 s moving average, 2 s lifetime and scale-in delay); its rules are the production ones. "Never below
2 workers" is checked on what the router lists and does not drain, whatever a busy machine does to health probes.
"""

from __future__ import annotations

import itertools
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from functools import partial
from pathlib import Path

import grpc
import pytest

from kvmesh.discovery.model import Role
from kvmesh.suite.launcher import ServiceProcess
from kvmesh.v1 import common_pb2, planner_pb2, planner_pb2_grpc, router_pb2, router_pb2_grpc
from tests.integration.router.test_follows_failover import passing
from tests.support.poll import wait_until
from tests.support.procs import start_together
from tests.support.registry import inst, register
from tests.support.scrape import metric

pytestmark = pytest.mark.integration
BS = 32
BASE_RPS, BURST = 2.0, 10


class Load:
    """Requests at a set rate from a few threads (paced, bounded); records every outcome."""

    def __init__(self, address: str) -> None:
        self.address = address
        self.rate = BASE_RPS
        self.sent = 0
        self.failed: list[str] = []
        self.stop = threading.Event()
        self._lock = threading.Lock()

    def one(self, k: int) -> None:
        req = router_pb2.RouterServiceGenerateRequest(
            token_ids=common_pb2.TokenIds(ids=[(7 * k + i) % 1000 + 3 for i in range(2 * BS)]),
            sampling=common_pb2.SamplingParams(max_tokens=2, ignore_eos=True),
        )
        try:
            with grpc.insecure_channel(self.address) as ch:
                msgs = list(router_pb2_grpc.RouterServiceStub(ch).Generate(req, timeout=30))
            if msgs[-1].finish_reason != common_pb2.FINISH_REASON_LENGTH:
                raise AssertionError(f"finish {msgs[-1].finish_reason}")
        except Exception as e:  # every failure is a lost request, recorded
            with self._lock:
                self.failed.append(repr(e))

    def run(self, limit: int = 5000) -> None:
        with ThreadPoolExecutor(8) as pool:
            nxt = time.monotonic()
            while not self.stop.is_set() and self.sent < limit:
                pool.submit(self.one, self.sent)
                self.sent += 1
                nxt += 1.0 / self.rate
                self.stop.wait(max(nxt - time.monotonic(), 0.0))  # pacing, not synchronisation


def test_planner_scales_out_under_a_burst_and_back_in(services: Callable[..., ServiceProcess], tmp_path: Path) -> None:
    reg = tmp_path / "registry.yaml"
    cm = services("cache-manager", "--block-size", str(BS))
    worker_args = f"--engine sim --sim-speed 0 --block-size {BS} --cache-manager {cm.address}"
    w0, w1 = start_together(*[partial(services, "worker", *worker_args.split())] * 2)
    register(reg, inst("a-cm", Role.CACHE_MANAGER, cm.address), inst("a-w0", Role.WORKER, w0.address),
             inst("a-w1", Role.WORKER, w1.address))  # fmt: skip
    fo = services(
        "failover", "--registry-file", str(reg), "--zones", "a", "--zone", "a", "--lkg-file", str(tmp_path / "lkg"),
        "--health-interval-s", "0.5", "--min-dwell-s", "0", "--up-hold-s", "0", "--ramp-s", "0",
    )  # fmt: skip
    router = services("router", "--failover", fo.address, "--zone", "a", "--block-size", str(BS))
    planner = services(
        "planner", "--routers", f"a={router.address}", "--actuator", "local", "--registry-file", str(reg),
        "--worker-args", worker_args, "--worker-log-dir", str(tmp_path / "planned"), "--interval-s", "0.5",
        "--bucket-s", "1", "--horizon-buckets", "3", "--average-window-s", "3", "--per-worker-rps", "4",
        "--min-workers", "2", "--max-workers", "4", "--min-lifetime-s", "2", "--scale-in-delay-s", "2",
        "--scale-in-cooldown-s", "1", "--history-file", str(tmp_path / "history.json"),
    )  # fmt: skip
    static = {w0.address, w1.address}
    with grpc.insecure_channel(router.address) as ch:
        admin = router_pb2_grpc.RouterAdminServiceStub(ch)
        wait_until(lambda: len(passing(admin)) == 2, 20.0)
        fleet_sizes: list[int] = []  # workers the router lists and does not drain (health aside), sampled
        planned_served: dict[str, int] = {}  # requests routed to each worker the planner started
        watching = threading.Event()

        def sample() -> list[router_pb2.WorkerStatus]:
            try:
                workers = list(admin.ListWorkers(router_pb2.ListWorkersRequest(), timeout=5).workers)
            except grpc.RpcError:
                return []  # a slow answer on a busy machine: the next poll samples again
            fleet_sizes.append(sum(1 for w in workers if not w.draining))
            for w in workers:
                if w.endpoint.address not in static:
                    planned_served[w.endpoint.address] = int(w.selections_total)
            return workers

        def watch() -> None:
            while not watching.wait(0.1):
                sample()

        load = Load(router.address)
        threads = [threading.Thread(target=load.run), threading.Thread(target=watch)]
        for t in threads:
            t.start()
        try:
            load.rate = BASE_RPS * BURST
            # the burst lasts until a worker the planner started has served part of it
            wait_until(lambda: any(n > 0 for n in planned_served.values()), 90.0)
            load.rate = BASE_RPS
            wait_until(lambda: _planned_stopped(planner) and only(static, sample()), 90.0)
        finally:
            load.stop.set()
            watching.set()
            for t in threads:
                t.join(timeout=60)
    assert load.failed == [], load.failed[:5]
    assert max(fleet_sizes) > 2 and min(fleet_sizes) >= 2, fleet_sizes
    assert _actions(planner, "scale_out") >= 1
    assert _actions(planner, "drain") == _actions(planner, "scale_in") >= 1  # every scale-in was drained first
    assert (tmp_path / "history.json").exists()
    # what it decided, as `kvmesh planner` reads it: the scale-out and the scale-in, with their reasons
    with grpc.insecure_channel(planner.address) as ch:
        plan = planner_pb2_grpc.PlannerServiceStub(ch).GetPlan(planner_pb2.GetPlanRequest(), timeout=10)
    (zone,) = plan.zones
    assert (plan.actuator, zone.zone, zone.forecaster, zone.error) == ("local", "a", "moving_average", "")
    assert zone.last.serving >= 2 and zone.history_buckets > 0 and len(zone.forecast) == 3
    assert any(d.add >= 1 and d.reason for d in zone.decisions), zone.decisions
    assert any(d.remove and "forecast needs" in d.reason for d in zone.decisions), zone.decisions
    steps = [(d.add, tuple(d.remove), d.reason, d.desired, d.serving, d.starting) for d in zone.decisions]
    assert all(a != b for a, b in itertools.pairwise(steps)), steps  # a repeated decision is kept once


def only(addresses: set[str], workers: list[router_pb2.WorkerStatus]) -> bool:
    """The router lists exactly `addresses` (an empty sample, a failed poll, proves nothing)."""
    return bool(workers) and {w.endpoint.address for w in workers} == addresses


def _actions(planner: ServiceProcess, action: str) -> float:
    return metric(planner.http_port, "kvmesh_planner_actions_total", f'action="{action}"')


def _planned_stopped(planner: ServiceProcess) -> bool:
    """The planner started workers and has stopped every one of them."""
    out = _actions(planner, "scale_out")
    return out >= 1 and _actions(planner, "scale_in") >= out
