"""Canary rollouts in the failover service, with real processes: a failover service over the static registry
and simulated workers of four versions (v1 serving; v2 a slower build, every engine iteration 25 ms longer;
v3 a good build; v4 another model, its tokens changed by an output salt). A rollout of v2 is rolled back
automatically at its first step (5 %), never above 10 %; a rollout of v3 reaches 100 %, and v1's standby
ends after the (short) standby time; a rollout of v4 after v3 is rolled back on output consistency. Events
come back from `GetRollout` and the failover's log, metrics from its /metrics page. Waits are bounded polls
on conditions.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from functools import partial
from pathlib import Path

import grpc
import pytest

from kvmesh.discovery.model import Role, ServiceInstance
from kvmesh.suite.launcher import ServiceProcess
from kvmesh.v1 import common_pb2, failover_pb2, failover_pb2_grpc
from tests.support.procs import start_together
from tests.support.registry import register
from tests.support.scrape import metric

pytestmark = pytest.mark.integration
ROLLED_BACK = failover_pb2.ROLLOUT_PHASE_ROLLED_BACK
COMPLETE = failover_pb2.ROLLOUT_PHASE_COMPLETE
DONE = (ROLLED_BACK, failover_pb2.ROLLOUT_PHASE_PROMOTED, COMPLETE)


def worker(iid: str, version: str, sp: ServiceProcess) -> ServiceInstance:
    host, _, port = sp.address.rpartition(":")
    return ServiceInstance(iid, Role.WORKER, "a", version, host, int(port))


def follow(stub: failover_pb2_grpc.FailoverServiceStub, until: Callable[[failover_pb2.Rollout], bool]) -> list[float]:
    """Polls GetRollout and GetTrafficWeights until `until` holds (bounded: 60 s, 6000 polls); returns the
    new version's weight at every poll."""
    seen: list[float] = []
    deadline = time.monotonic() + 60
    for _ in range(6000):
        r = stub.GetRollout(failover_pb2.GetRolloutRequest(), timeout=5).rollout
        w = stub.GetTrafficWeights(failover_pb2.GetTrafficWeightsRequest(), timeout=5).weights.version_weights
        seen.append(w.get(r.new_version, 0.0))
        if until(r):
            return seen
        if time.monotonic() > deadline:
            break
        time.sleep(0.02)
    raise AssertionError(f"rollout did not get there: {r}")


def test_slow_version_rolled_back_before_10_percent_good_one_promoted(
    services: Callable[..., ServiceProcess], tmp_path: Path
) -> None:
    reg = tmp_path / "registry.yaml"
    sim = ("--engine", "sim", "--block-size", "16", "--kv-blocks", "1024")
    w1, w2, w3, w4 = start_together(
        partial(services, "worker", *sim, "--version", "v1"),
        partial(services, "worker", *sim, "--version", "v2", "--sim-extra-step-ms", "25"),
        partial(services, "worker", *sim, "--version", "v3"),
        partial(services, "worker", *sim, "--version", "v4", "--sim-output-salt", "7"),
    )
    register(reg, *(worker(f"w-v{i}", f"v{i}", w) for i, w in enumerate((w1, w2, w3, w4), 1)))
    fo = services(
        "failover",
        *("--registry-file", str(reg), "--zones", "a", "--zone", "a", "--require-cache-manager", "false"),
        *("--health-interval-s", "0.2", "--up-hold-s", "0", "--min-dwell-s", "0", "--ramp-s", "0"),
        *("--version-weights", "v1=1", "--rollout-hold-s", "1", "--rollout-check-interval-s", "0.3"),
        *("--rollout-standby-s", "2", "--rollout-probes", "4", "--rollout-probe-max-tokens", "8"),
    )
    with grpc.insecure_channel(fo.address) as ch:
        stub = failover_pb2_grpc.FailoverServiceStub(ch)
        with pytest.raises(grpc.RpcError) as bad:
            stub.StartRollout(failover_pb2.StartRolloutRequest(new_version="v2"), timeout=5)
        assert bad.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "old_version" in (bad.value.details() or "")
        # wait for the workers to be up in the endpoint sets (a rollout measures the versions' up workers)
        watch = stub.WatchEndpoints(
            failover_pb2.WatchEndpointsRequest(roles=[common_pb2.SERVICE_ROLE_WORKER]), timeout=30
        )
        for msg in watch:
            if len([e for z in msg.zones for e in z.endpoints]) == 4:
                break
        watch.cancel()

        started = stub.StartRollout(failover_pb2.StartRolloutRequest(new_version="v2", old_version="v1"), timeout=5)
        assert started.rollout.new_share == pytest.approx(0.05)
        with pytest.raises(grpc.RpcError) as busy:
            stub.StartRollout(failover_pb2.StartRolloutRequest(new_version="v3", old_version="v1"), timeout=5)
        assert busy.value.code() == grpc.StatusCode.FAILED_PRECONDITION
        shares = follow(stub, lambda r: r.phase in DONE)
        r = stub.GetRollout(failover_pb2.GetRolloutRequest(), timeout=5).rollout
        assert r.phase == ROLLED_BACK, r
        assert max(shares) <= 0.10 and r.max_new_share <= 0.10
        assert "latency" in r.failed_checks and r.latency_regression > 0.15
        assert r.consistency == pytest.approx(1.0)  # same outputs: only slower
        assert r.events[-1].kind == "rolled_back" and "latency" in r.events[-1].message
        weights = stub.GetTrafficWeights(failover_pb2.GetTrafficWeightsRequest(), timeout=5).weights
        assert dict(weights.version_weights) == {"v1": 1.0}
        assert metric(fo.http_port, "kvmesh_rollout_rollbacks_total", 'reason="latency"') == 1
        assert metric(fo.http_port, "kvmesh_rollout_verdicts_total", 'check="latency"') >= 1
        assert metric(fo.http_port, "kvmesh_rollout_step_pct", 'version="v2"') == 0

        stub.StartRollout(failover_pb2.StartRolloutRequest(new_version="v3", old_version="v1"), timeout=5)
        shares = follow(stub, lambda r: r.phase == COMPLETE or r.phase == ROLLED_BACK)
        r = stub.GetRollout(failover_pb2.GetRolloutRequest(), timeout=5).rollout
        assert r.phase == COMPLETE, r
        assert [e.kind for e in r.events] == ["started", "step", "step", "promoted", "standby_expired"]
        assert sorted(set(round(s, 2) for s in shares)) <= [0.05, 0.1, 0.5, 1.0] and max(shares) == 1.0
        weights = stub.GetTrafficWeights(failover_pb2.GetTrafficWeightsRequest(), timeout=5).weights
        assert dict(weights.version_weights) == {"v3": 1.0, "v1": 0.0}  # v1 kept registered, weight 0
        assert metric(fo.http_port, "kvmesh_rollout_promotions_total") == 1
        assert metric(fo.http_port, "kvmesh_rollout_step_pct", 'version="v3"') == 100
        assert metric(fo.http_port, "kvmesh_rollout_verdicts_total", 'result="pass"') >= 3

        stub.StartRollout(failover_pb2.StartRolloutRequest(new_version="v4", old_version="v3"), timeout=5)
        shares = follow(stub, lambda r: r.phase in DONE)
        r = stub.GetRollout(failover_pb2.GetRolloutRequest(), timeout=5).rollout
        assert r.phase == ROLLED_BACK and max(shares) <= 0.10 and list(r.failed_checks) == ["consistency"], r
        assert r.consistency < 0.99 and abs(r.latency_regression) < 0.15
        weights = stub.GetTrafficWeights(failover_pb2.GetTrafficWeightsRequest(), timeout=5).weights
        assert dict(weights.version_weights) == {"v3": 1.0, "v1": 0.0}
        assert metric(fo.http_port, "kvmesh_rollout_rollbacks_total", 'reason="consistency"') == 1
    log = fo.log()
    assert "rollout event rolled_back: v2 at 5 % failed latency" in log
    assert "rollout event promoted: v3 promoted to 100 %" in log
    assert "rollout event standby_expired: standby of v1 over" in log
    assert "rollout event rolled_back: v4 at 5 % failed consistency" in log
