"""Fleet control on a two-zone `kvmesh up` suite (simulated workers, one per zone), as an operator following the
docs meets it: weights that name a zone or version that does not exist are refused by the failover service (CLI
and RPC alike); draining a zone's last worker in rotation needs --force and `kvmesh zones` then says the zone
cannot route; every admin command reaches zone b with --zone, or by its address with the suite's credential; the
guardrails, the warming policy, replication and the planner are reachable from the CLI (and only as admin);
`kvmesh logs` reads this run's logs."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import grpc
import pytest
import yaml

from kvmesh.v1 import common_pb2, failover_pb2, failover_pb2_grpc, router_pb2, router_pb2_grpc
from tests.support.cli import kvmesh_cli
from tests.support.poll import wait_until

pytestmark = [pytest.mark.integration]

RULES = {"rules": [{"name": "secret", "words": ["hunter2"], "action": "mask"}]}


class Suite:
    def __init__(self, home: Path, rules: Path) -> None:
        self.home = home
        self.rules = rules
        self.state: dict[str, Any] = json.loads((home / "run" / "suite.json").read_text())

    def address(self, name: str, zone: str) -> str:
        return str(next(s["grpc"] for s in self.state["services"] if s["name"] == name and s["zone"] == zone))

    def token(self, who: str) -> str:
        return Path(self.state["auth"]["tokens"][who]).read_text().strip()

    def metadata(self, who: str = "admin") -> tuple[tuple[str, str]]:
        return (("authorization", f"Bearer {self.token(who)}"),)

    def json(self, *args: str) -> Any:
        done = kvmesh_cli(self.home, *args, "--json")
        assert done.returncode == 0, done.stdout + done.stderr
        return json.loads(done.stdout)


@pytest.fixture(scope="module")
def suite(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Suite]:
    base = tmp_path_factory.mktemp("fleet")
    rules = base / "guardrails.yaml"
    rules.write_text(yaml.safe_dump(RULES))
    config = base / "suite.yaml"
    config.write_text(
        yaml.safe_dump(
            {
                "zones": [{"name": "a"}, {"name": "b"}],
                "ports": {"auto": True},
                "worker": {"replicas": 1, "simSpeed": 0},
                "planner": {"intervalS": 1},
                "router": {"guardrails": "guardrails.yaml"},  # relative to the config file
            }
        )
    )
    home = base / "home"
    up = kvmesh_cli(home, "up", "--detach", "--config", str(config), timeout=240)
    assert up.returncode == 0, up.stdout + up.stderr
    try:
        s = Suite(home, rules)
        with grpc.insecure_channel(s.address("failover", "a")) as ch:  # both zones serving (event-driven watch)
            stream = failover_pb2_grpc.FailoverServiceStub(ch).WatchEndpoints(
                failover_pb2.WatchEndpointsRequest(), timeout=60
            )
            for resp in stream:
                if len(resp.zones) == 2 and all(z.healthy for z in resp.zones):
                    break
            stream.cancel()
        yield s
    finally:
        down = kvmesh_cli(home, "down", timeout=120)
        assert down.returncode == 0, down.stdout + down.stderr


def test_weights_name_real_zones_and_versions_only(suite: Suite) -> None:
    before = suite.json("weights")
    typo = kvmesh_cli(suite.home, "weights", "--zones", "c=0.9")  # a zone the fleet does not have
    assert typo.returncode == 1, typo.stdout
    assert "INVALID_ARGUMENT: weights.zone_weights[c]: unknown zone 'c' (known: a, b)" in typo.stderr, typo.stderr
    with grpc.insecure_channel(suite.address("failover", "b")) as ch:  # the RPC itself, not only the CLI
        stub = failover_pb2_grpc.FailoverServiceStub(ch)
        for weights, says in (
            (failover_pb2.TrafficWeights(zone_weights={"a ": 1}), "weights.zone_weights[a ]: unknown zone 'a '"),
            (failover_pb2.TrafficWeights(version_weights={"v9": 1}), "unknown version 'v9' (known: v1)"),
        ):
            with pytest.raises(grpc.RpcError) as err:
                stub.SetTrafficWeights(
                    failover_pb2.SetTrafficWeightsRequest(weights=weights), timeout=10, metadata=suite.metadata()
                )
            assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT and says in (err.value.details() or "")
        stored = stub.GetTrafficWeights(failover_pb2.GetTrafficWeightsRequest(), timeout=10, metadata=suite.metadata())
    assert dict(stored.weights.zone_weights) == before["zone_weights"]  # nothing stored
    done = kvmesh_cli(suite.home, "weights", "--zones", "a=0.9,b=0.1")
    assert done.returncode == 0, done.stderr
    assert done.stdout.splitlines()[0] == "traffic weights set: zones a 90.0%, b 10.0%; versions v1 100.0%"
    assert suite.json("weights", "--rollback")["zone_weights"] == before["zone_weights"]


def test_draining_a_zone_s_last_worker_needs_force(suite: Suite) -> None:
    refused = kvmesh_cli(suite.home, "drain", "worker-b-0", "--zone", "b")
    assert refused.returncode == 1, refused.stdout
    assert "FAILED_PRECONDITION: draining worker-b-0 would leave zone 'b' with no worker in rotation" in refused.stderr
    assert "a drain with force set takes it out anyway: `kvmesh drain worker-b-0 --zone b --force`" in refused.stderr
    with grpc.insecure_channel(suite.address("router", "b")) as ch, pytest.raises(grpc.RpcError) as err:
        router_pb2_grpc.RouterAdminServiceStub(ch).DrainWorker(  # the RPC itself
            router_pb2.DrainWorkerRequest(worker_id="worker-b-0", drain=True), timeout=10, metadata=suite.metadata()
        )
    assert err.value.code() == grpc.StatusCode.FAILED_PRECONDITION and "zone 'b'" in (err.value.details() or "")
    assert {w["state"] for w in suite.json("workers", "--zone", "b")["workers"]} == {"passing"}  # not drained
    forced = suite.json("drain", "worker-b-0", "--zone", "b", "--force")
    assert forced["draining"] is True
    try:
        zones = {z["zone"]: z for z in suite.json("zones")["zones"]}
        assert (zones["b"]["healthy"], zones["b"]["routable"], zones["b"]["draining"]) == (True, 0, 1)
        assert zones["a"]["routable"] == 1
        text = kvmesh_cli(suite.home, "zones")
        row = next(line.split() for line in text.stdout.splitlines() if line.startswith("b "))
        assert row[1] == "UNROUTABLE" and "no worker in rotation: 1 draining" in text.stdout, text.stdout
    finally:
        suite.json("undrain", "worker-b-0", "--zone", "b")
    assert {z["zone"]: z["routable"] for z in suite.json("zones")["zones"]} == {"a": 1, "b": 1}


def test_zone_b_by_zone_or_by_its_address(suite: Suite) -> None:
    assert [w["id"] for w in suite.json("workers")["workers"]] == ["worker-a-0"]  # the first zone by default
    assert [w["id"] for w in suite.json("workers", "--zone", "b")["workers"]] == ["worker-b-0"]
    by_address = suite.json("workers", "--router", suite.address("router", "b"))  # the suite's own: its credential
    assert [w["id"] for w in by_address["workers"]] == ["worker-b-0"]
    assert suite.json("index", "--zone", "b")["zone"] == "b"
    unknown = kvmesh_cli(suite.home, "workers", "--zone", "c")
    assert unknown.returncode == 2 and "has no zone 'c' (its zones: a, b)" in unknown.stderr, unknown.stderr
    bogus = kvmesh_cli(suite.home, "workers", "--zone", "b", "--token", "not-a-token")
    assert bogus.returncode == 3, bogus.stderr
    assert "UNAUTHENTICATED, needs role admin; give an admin credential: --token-file FILE" in bogus.stderr
    assert suite.state["auth"]["tokens"]["admin"] in bogus.stderr and "--api-key" not in bogus.stderr


def test_replication_state_in_index(suite: Suite) -> None:
    doc = suite.json("index", "--zone", "a")
    (target,) = doc["replication"]
    assert target["zone"] == "b" and target["budget_bytes_per_s"] == 50e6
    assert [z["zone"] for z in doc["followed_zones"]] == ["b"]
    text = kvmesh_cli(suite.home, "index", "--zone", "a")
    assert "hot prefixes replicated from zone a:" in text.stdout, text.stdout


def test_warming_policy(suite: Suite) -> None:
    before = suite.json("warming", "--zone", "b")
    assert before["action"] == "get" and before["hot_threshold"] >= 1
    doc = suite.json("warming", "--zone", "b", "--hot-threshold", "9", "--lfu-weight", "0.25")
    assert (doc["action"], doc["hot_threshold"], doc["lfu_weight"]) == ("set", 9, 0.25)
    assert suite.json("index", "--zone", "b")["warming_policy"]["hot_threshold"] == 9
    assert suite.json("index", "--zone", "a")["warming_policy"]["hot_threshold"] == before["hot_threshold"]
    bad = kvmesh_cli(suite.home, "warming", "--zone", "b", "--lfu-weight", "2")
    assert bad.returncode == 1 and "INVALID_ARGUMENT: policy.lfu_weight: must be in [0, 1]" in bad.stderr, bad.stderr
    zero = kvmesh_cli(suite.home, "warming", "--zone", "b", "--capacity", "0")  # 0 would read as "keep"
    assert zero.returncode == 2 and "--capacity: must be > 0" in zero.stderr


def test_guardrails_read_and_reload(suite: Suite) -> None:
    doc = suite.json("guardrails", "--zone", "b")
    assert (doc["enabled"], doc["rules"], doc["path"]) == (True, 1, str(suite.rules))
    two = {"rules": [*RULES["rules"], {"name": "stop-words", "words": ["abort now"], "action": "stop"}]}
    tmp = suite.rules.with_suffix(".tmp")
    tmp.write_text(yaml.safe_dump(two))
    tmp.replace(suite.rules)  # atomically, as docs/security.md asks
    doc = suite.json("guardrails", "--zone", "b", "--reload")
    assert doc["rules"] == 2 and doc["version"] >= 2  # changed, or the router's own poll was first
    suite.rules.write_text("rules:\n  - name: broken\n    action: mask\n")  # neither pattern nor words
    bad = kvmesh_cli(suite.home, "guardrails", "--zone", "b", "--reload")
    assert bad.returncode == 1 and f"INVALID_ARGUMENT: guardrails: {suite.rules}" in bad.stderr, bad.stderr
    assert suite.json("guardrails", "--zone", "b")["rules"] == 2  # the previous rules stay in force
    text = kvmesh_cli(suite.home, "guardrails", "--zone", "b")
    assert f"2 guardrail rules from {suite.rules}" in text.stdout, text.stdout


def test_planner_forecast_and_decisions(suite: Suite) -> None:
    docs: list[Any] = []

    def planned() -> bool:  # its 1 s planning step has run in both zones
        docs.append(suite.json("planner", "--zone", "b"))
        return all(z["last"] is not None for z in docs[-1]["zones"])

    wait_until(planned, 30.0)
    doc = docs[-1]
    assert doc["actuator"] == "dry-run" and [z["zone"] for z in doc["zones"]] == ["b"]
    (zone,) = doc["zones"]
    assert zone["forecaster"] == "moving_average" and zone["error"] == ""
    # one serving worker, the suite's planner keeps two warm: it would add one (dry run: it starts none)
    assert (zone["last"]["desired"], zone["last"]["serving"], zone["last"]["add"]) == (2, 1, 1)
    assert zone["decisions"] and zone["decisions"][-1]["reason"] == "forecast needs 2, have 1"
    text = kvmesh_cli(suite.home, "planner", "--zone", "b")
    assert "zone b: forecaster moving_average" in text.stdout and "desired 2: add 1" in text.stdout, text.stdout


def test_logs_of_this_run(suite: Suite) -> None:
    done = kvmesh_cli(suite.home, "logs", "router", "--zone", "b", "--lines", "5")
    assert done.returncode == 0, done.stderr
    header = done.stdout.splitlines()[0]
    assert header.startswith("==> router-b-") and str(suite.home / "run" / "current" / "logs") in header
    assert len(done.stdout.splitlines()) <= 6
    every = kvmesh_cli(suite.home, "logs", "--lines", "1")
    assert every.stdout.count("==> ") == 10  # five services a zone
    nope = kvmesh_cli(suite.home, "logs", "nope")
    assert nope.returncode == 2 and "no service 'nope'" in nope.stderr


def test_a_fresh_suite_counts_no_gap_or_resync(suite: Suite) -> None:
    """The first request of a fresh suite: its worker's first sync was a dump, not a gap and a resync."""
    with grpc.insecure_channel(suite.address("router", "a")) as ch:
        req = router_pb2.RouterServiceGenerateRequest(
            token_ids=common_pb2.TokenIds(ids=list(range(3, 99))),
            sampling=common_pb2.SamplingParams(max_tokens=2, ignore_eos=True),
        )
        stub = router_pb2_grpc.RouterServiceStub(ch)
        steps = list(stub.Generate(req, timeout=30, metadata=suite.metadata("client")))
    assert steps[-1].usage.completion_tokens == 2
    docs: list[Any] = []
    wait_until(lambda: docs.append(suite.json("index", "--zone", "a")) or docs[-1]["blocks"] > 0, 20.0)
    assert (docs[-1]["gaps_total"], docs[-1]["resyncs_total"]) == (0, 0)
