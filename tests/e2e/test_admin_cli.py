"""Every admin command (`kvmesh workers|rebalance|drain|undrain|zones|weights|index|top`) against one running
`kvmesh up` suite, `--json` output checked: as the suite's operator (its default credential), as a remote
target given by flags, with the demo client's token (every command denied, exit 3), and against an address
where nothing listens (exit 4)."""

from __future__ import annotations

import json
import socket
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import grpc
import pytest

from kvmesh.v1 import (
    cache_manager_pb2,
    cache_manager_pb2_grpc,
    common_pb2,
    failover_pb2,
    failover_pb2_grpc,
    router_pb2,
    router_pb2_grpc,
)
from tests.support.cli import kvmesh_cli
from tests.support.poll import wait_until

pytestmark = [pytest.mark.integration]


class Suite:
    def __init__(self, home: Path) -> None:
        self.home = home
        self.state: dict[str, Any] = json.loads((home / "run" / "suite.json").read_text())

    def address(self, name: str) -> str:
        return str(next(s["grpc"] for s in self.state["services"] if s["name"] == name))

    def token_file(self, who: str) -> str:
        return str(self.state["auth"]["tokens"][who])

    def json(self, *args: str) -> Any:
        """`kvmesh ARGS --json` as the operator: exit 0 and one JSON document on stdout."""
        done = kvmesh_cli(self.home, *args, "--json")
        assert done.returncode == 0, done.stdout + done.stderr
        return json.loads(done.stdout)


def _wait_zone_healthy(failover: str) -> None:
    """The failover service's endpoint watch (event-driven) until the zone can serve, bounded by its deadline."""
    with grpc.insecure_channel(failover) as ch:
        stream = failover_pb2_grpc.FailoverServiceStub(ch).WatchEndpoints(
            failover_pb2.WatchEndpointsRequest(), timeout=30
        )
        for resp in stream:
            if resp.zones and resp.zones[0].healthy:
                break
        stream.cancel()


def _one_request(suite: Suite) -> None:
    req = router_pb2.RouterServiceGenerateRequest(
        token_ids=common_pb2.TokenIds(ids=list(range(3, 99))),
        sampling=common_pb2.SamplingParams(max_tokens=4, ignore_eos=True),
    )
    token = Path(suite.token_file("client")).read_text().strip()
    with grpc.insecure_channel(suite.address("router")) as ch:
        steps = list(
            router_pb2_grpc.RouterServiceStub(ch).Generate(
                req, timeout=60, metadata=(("authorization", f"Bearer {token}"),)
            )
        )
    assert steps[-1].usage.completion_tokens == 4


@pytest.fixture(scope="module")
def suite(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Suite]:
    home = tmp_path_factory.mktemp("admin") / "home"
    up = kvmesh_cli(home, "up", "--detach", "--ports", "auto", "--workers", "2", timeout=180)
    assert up.returncode == 0, up.stdout + up.stderr
    try:
        s = Suite(home)
        _wait_zone_healthy(s.address("failover"))
        _one_request(s)  # something routed and cached, for the selections and the index
        yield s
    finally:
        down = kvmesh_cli(home, "down", timeout=120)
        assert down.returncode == 0, down.stdout + down.stderr


def test_workers(suite: Suite) -> None:
    doc = suite.json("workers")
    assert doc["router"] == suite.address("router")
    assert sorted(w["id"] for w in doc["workers"]) == ["worker-local-0", "worker-local-1"]
    for w in doc["workers"]:
        assert (w["state"], w["health"], w["circuit"], w["draining"]) == ("passing", "passing", "closed", False)
        assert w["kv_blocks_total"] > 0 and 0.0 <= w["kv_usage"] <= 1.0
    assert sum(w["selections_total"] for w in doc["workers"]) >= 1
    text = kvmesh_cli(suite.home, "workers")
    assert text.returncode == 0 and "worker-local-0" in text.stdout and "SELECTED" in text.stdout


def test_rebalance(suite: Suite) -> None:
    before = suite.json("workers")
    doc = suite.json("rebalance", "--prefill-weight", "0.7", "--decode-weight", "0.3")
    assert doc["prefill_weight"] == pytest.approx(0.7) and doc["decode_weight"] == pytest.approx(0.3)
    assert suite.json("workers")["prefill_weight"] == pytest.approx(0.7)
    bad = kvmesh_cli(suite.home, "rebalance", "--prefill-weight", "-1", "--decode-weight", "1")
    assert bad.returncode == 1 and "INVALID_ARGUMENT: prefill_weight" in bad.stderr, bad.stderr
    w = [str(before["prefill_weight"]), str(before["decode_weight"])]
    suite.json("rebalance", "--prefill-weight", w[0], "--decode-weight", w[1])


def test_drain_and_undrain(suite: Suite) -> None:
    doc = suite.json("drain", "worker-local-0")
    assert doc == {"router": suite.address("router"), "worker_id": "worker-local-0", "draining": True, "in_flight": 0}
    states = {w["id"]: w["state"] for w in suite.json("workers")["workers"]}
    assert states == {"worker-local-0": "draining", "worker-local-1": "passing"}
    assert suite.json("undrain", "worker-local-0")["draining"] is False
    assert {w["state"] for w in suite.json("workers")["workers"]} == {"passing"}
    unknown = kvmesh_cli(suite.home, "drain", "worker-nope")
    assert unknown.returncode == 1 and "NOT_FOUND: unknown worker 'worker-nope'" in unknown.stderr


def test_zones(suite: Suite) -> None:
    doc = suite.json("zones")
    assert doc["failover"] == suite.address("failover") and doc["registry_reachable"] is True
    (zone,) = doc["zones"]
    assert (zone["zone"], zone["healthy"], zone["weight"]) == ("local", True, 1.0)
    assert (zone["routers"], zone["cache_managers"], zone["workers"]) == (1, 1, 2)
    assert doc["version_weights"] == {"v1": 1.0}


def test_weights_get_set_rollback(suite: Suite) -> None:
    before = suite.json("weights")
    assert before["action"] == "get" and before["zone_weights"] == {"local": 1.0}
    doc = suite.json("weights", "--zones", "local=3", "--versions", "v1=2")  # stored normalised
    assert doc["action"] == "set" and (doc["zone_weights"], doc["version_weights"]) == ({"local": 1.0}, {"v1": 1.0})
    assert suite.json("zones")["version_weights"] == {"v1": 1.0}
    back = suite.json("weights", "--rollback")
    assert back["action"] == "rollback" and back["version_weights"] == before["version_weights"]
    bad = kvmesh_cli(suite.home, "weights", "--zones", "local")
    assert bad.returncode == 2 and "expected key=weight" in bad.stderr


def test_index(suite: Suite) -> None:
    _one_request(suite)  # routed within the statistics window (60 s) whatever the tests before took
    docs: list[Any] = []  # its report reaches the cache-manager within the router's flush interval
    wait_until(lambda: docs.append(suite.json("index")) or bool(docs[-1]["top_prefixes"]), 30.0)
    doc = docs[-1]
    assert doc["cache_manager"] == suite.address("cache-manager")
    assert doc["block_size"] == 32 and doc["blocks"] >= 1 and doc["pairs"] >= doc["blocks"]
    assert doc["warming_policy"]["hot_threshold"] >= 1
    # Prefix statistics count the prompts routers routed (reported from their index replicas: the request just
    # made is there already) and FindMatches queries: the router's fallback query made here, with its
    # identity, adds a prompt of 96 tokens, 3 blocks, observed at checkpoints 1, 2 and 3
    before = {p["key"] for p in doc["top_prefixes"]}
    assert before, "the request's routed prompt is counted"
    router_token = Path(suite.home / "run" / "auth" / "router-router-local.token").read_text().strip()
    with grpc.insecure_channel(suite.address("cache-manager")) as ch:
        cache_manager_pb2_grpc.CacheManagerServiceStub(ch).FindMatches(
            cache_manager_pb2.FindMatchesRequest(token_ids=common_pb2.TokenIds(ids=list(range(3, 99)))),
            timeout=10,
            metadata=(("authorization", f"Bearer {router_token}"),),
        )
    doc = suite.json("index")
    added = [(p["blocks"], p["window_count"]) for p in doc["top_prefixes"] if p["key"] not in before]
    assert sorted(added, reverse=True) == [(3, 1), (2, 1), (1, 1)]
    assert len(suite.json("index", "--top", "1")["top_prefixes"]) == 1
    too_many = kvmesh_cli(suite.home, "index", "--top", "1001")
    assert too_many.returncode == 1 and "INVALID_ARGUMENT: top_prefixes" in too_many.stderr, too_many.stderr


def test_top(suite: Suite) -> None:
    doc = suite.json("top", "--iterations", "2", "--interval", "0")
    assert len(doc["frames"]) == 2
    for frame in doc["frames"]:
        assert len(frame["workers"]["workers"]) == 2 and frame["zones"]["zones"][0]["zone"] == "local"
        assert frame["index"]["block_size"] == 32
    text = kvmesh_cli(suite.home, "top", "--iterations", "2", "--interval", "0")
    assert text.returncode == 0, text.stderr
    assert "frame 1/2" in text.stdout and "frame 2/2" in text.stdout and "\x1b[" not in text.stdout  # no TTY


def test_remote_target_by_flags(suite: Suite, tmp_path: Path) -> None:
    """No local suite in this KVMESH_HOME: addresses and the operator's token given by flags."""
    flags = ["--router", suite.address("router"), "--token-file", suite.token_file("admin")]
    done = kvmesh_cli(tmp_path, "workers", *flags, "--json")
    assert done.returncode == 0, done.stderr
    assert len(json.loads(done.stdout)["workers"]) == 2
    flags = ["--router", suite.address("router"), "--failover", suite.address("failover")]
    flags += ["--cache-manager", suite.address("cache-manager"), "--token-file", suite.token_file("admin")]
    top = kvmesh_cli(tmp_path, "top", *flags, "--json")
    assert top.returncode == 0, top.stderr
    (frame,) = json.loads(top.stdout)["frames"]
    assert {"workers", "zones", "index"} <= set(frame) and not any("error" in frame[k] for k in ("zones", "index"))
    anonymous = kvmesh_cli(tmp_path, "zones", "--failover", suite.address("failover"))  # no suite credential sent
    assert anonymous.returncode == 3 and "UNAUTHENTICATED, needs role admin" in anonymous.stderr


COMMANDS = [
    ["workers"],
    ["rebalance", "--prefill-weight", "0.7", "--decode-weight", "0.3"],
    ["drain", "worker-local-0"],
    ["undrain", "worker-local-0"],
    ["zones"],
    ["weights"],
    ["weights", "--zones", "local=1"],
    ["weights", "--rollback"],
    ["rollout"],
    ["index"],
    ["warming", "--hot-threshold", "3"],
    ["guardrails", "--reload"],
    ["planner"],
    ["top", "--iterations", "1"],
]


def test_a_client_credential_is_denied_everywhere(suite: Suite) -> None:
    """The demo client's token (role client): every admin command exits 3 naming the role it needs, and
    prints no document; the operator's state is unchanged (no drain happened)."""
    for cmd in COMMANDS:
        done = kvmesh_cli(suite.home, *cmd, "--json", "--token-file", suite.token_file("client"))
        assert done.returncode == 3, (cmd, done.stdout, done.stderr)
        if cmd[0] == "top":
            (frame,) = json.loads(done.stdout)["frames"]
            assert all("needs role admin" in frame[k]["error"] for k in ("workers", "zones", "index")), frame
        else:
            assert done.stdout == "" and "PERMISSION_DENIED, needs role admin" in done.stderr, (cmd, done.stderr)
    assert {w["state"] for w in suite.json("workers")["workers"]} == {"passing"}


def test_unreachable_names_the_address(suite: Suite) -> None:
    with socket.socket() as s:  # a port nothing listens on once closed
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    done = kvmesh_cli(suite.home, "workers", "--router", f"127.0.0.1:{port}", "--timeout", "5")
    assert done.returncode == 4, done.stderr
    assert f"cannot reach the router at 127.0.0.1:{port} (flag, plaintext): UNAVAILABLE" in done.stderr


def test_rollout_start_and_read(suite: Suite) -> None:
    """Last in the module: the rollout it starts holds the version weights at 5 % for v2 (which has no worker:
    its first check, 30 s on, rolls it back)."""
    assert suite.json("rollout") == {"failover": suite.address("failover"), "rollout": None}
    r = suite.json("rollout", "--start", "v2", "--old", "v1")["rollout"]
    assert (r["new_version"], r["old_version"], r["phase"]) == ("v2", "v1", "running")
    assert r["new_share"] == pytest.approx(0.05) and [e["kind"] for e in r["events"]] == ["started"]
    assert suite.json("zones")["version_weights"] == pytest.approx({"v1": 0.95, "v2": 0.05})
    assert suite.json("rollout")["rollout"]["phase"] == "running"
    text = kvmesh_cli(suite.home, "rollout")
    assert (
        text.returncode == 0
        and "rollout v1 -> v2: running, new version at 5% (at most 5%)\nlast check: none yet" in text.stdout
    ), text.stdout
    again = kvmesh_cli(suite.home, "rollout", "--start", "v3", "--old", "v1")
    assert again.returncode == 1 and "FAILED_PRECONDITION: rollout of v2 is running" in again.stderr, again.stderr
    half = kvmesh_cli(suite.home, "rollout", "--start", "v3")
    assert half.returncode == 2 and "--start NEW and --old OLD go together" in half.stderr
