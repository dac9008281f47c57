"""kvmesh.suite.config: the local suite's settings (file, --set, flags), its port plan, and one test per error."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import yaml

from kvmesh.suite.config import ConfigError, load, parse, plan

pytestmark = [pytest.mark.unit]

EXAMPLES = Path(__file__).resolve().parents[3] / "docs" / "examples"
TWO = {"zones": [{"name": "a"}, {"name": "b"}]}


def _error(raw: Any) -> str:
    with pytest.raises(ConfigError) as err:
        parse(raw)
    return str(err.value)


def test_defaults_are_the_documented_ports() -> None:
    s = parse(None)
    (z,) = s.zones
    assert (z.name, z.router.http_port, z.router.grpc_port) == ("local", 8000, 50051)
    assert (z.cache_manager.grpc_port, z.failover.grpc_port, z.worker.grpc_port) == (50052, 50053, 50060)
    ports = {p.port: p for p in plan(s)}
    expected = {8000, 50051, 50052, 50053, 50054, 50060, 50061, 51052, 51053, 51054, 51060, 51061, 52060, 52061}
    assert expected == set(ports)
    assert {p.port for p in plan(parse({"planner": {"enabled": False}}))} == expected - {50054, 51054}
    assert ports[8000].flag == "--http-port" and ports[50051].flag == "--grpc-port"
    assert ports[50061].key == "worker.grpcPort + 1" and ports[50052].flag == "--set cacheManager.grpcPort=N"


def test_zone_k_adds_the_stride_to_every_port_it_does_not_set() -> None:
    s = parse({"zones": [{"name": "a"}, {"name": "b", "router": {"httpPort": 9000}, "worker": {"replicas": 1}}]})
    a, b = s.zones
    assert (a.router.http_port, b.router.http_port, b.router.grpc_port) == (8000, 9000, 50151)
    assert (b.cache_manager.grpc_port, b.worker.grpc_port, b.worker.replicas, a.worker.replicas) == (50152, 50160, 1, 2)
    assert parse({**TWO, "ports": {"zoneStride": 200}}).zones[1].router.grpc_port == 50251


def test_ports_auto_makes_every_port_free_and_plans_none() -> None:
    s = parse({**TWO, "ports": {"auto": True}, "redis": {"enabled": True}})
    assert {z.router.http_port for z in s.zones} == {0} and s.redis.port == 0 and plan(s) == []


def test_flags_override_the_file_and_every_zone_entry(tmp_path: Path) -> None:
    f = tmp_path / "k.yaml"
    f.write_text("worker: {replicas: 1}\nzones:\n  - {name: a, worker: {replicas: 3, engine: vllm}}\n  - {name: b}\n")
    s = load(f, ["zones[1].router.longPromptTokens=100"], {"worker.replicas": 2, "router.httpPort": 7000, "x": None})
    assert [z.worker.replicas for z in s.zones] == [2, 2]
    assert [z.worker.engine for z in s.zones] == ["vllm", "sim"]  # a flag not given leaves the file alone
    assert [z.router.http_port for z in s.zones] == [7000, 7100]
    assert [z.router.long_prompt_tokens for z in s.zones] == [2048, 100]


def test_ports_auto_and_a_fixed_port_flag_is_an_error_not_a_silent_choice() -> None:
    with pytest.raises(ConfigError, match=r"^ports\.auto: --ports auto picks every port: drop --http-port"):
        load(None, (), {"ports.auto": True, "router.httpPort": 8000})
    assert load(None, (), {"ports.auto": False, "router.httpPort": 8001}).zones[0].router.http_port == 8001


def test_zone_flag_renames_the_one_zone_and_refuses_two() -> None:
    assert load(None, (), {"zone": "z1"}).zones[0].name == "z1"
    with pytest.raises(ConfigError, match=r"^zone: --zone names the one zone"):
        load(None, ["zones=[{name: a}, {name: b}]"], {"zone": "z1"})


def test_inline_routing_profile_is_checked_and_a_relative_path_is_the_files(tmp_path: Path) -> None:
    good = {"name": "p", "scorers": [{"type": "cost", "weight": 1.0}], "picker": {"type": "min-cost"}}
    assert parse({"router": {"profile": good}}).zones[0].router.profile == good
    assert _error({"router": {"profile": {"scorers": [{"type": "nope"}]}}}).startswith(
        "router.profile: bad routing profile"
    )
    f = tmp_path / "k.yaml"
    f.write_text("router: {profile: prof.yaml}\n")
    with pytest.raises(ConfigError, match=r"^router\.profile: cannot read .*prof\.yaml"):
        load(f)
    (tmp_path / "prof.yaml").write_text("scorers: [{type: nope}]\n")
    with pytest.raises(ConfigError, match=r"^router\.profile: bad routing profile"):
        load(f)
    (tmp_path / "prof.yaml").write_text(yaml.safe_dump(good))
    assert load(f).zones[0].router.profile == str(tmp_path / "prof.yaml")


def test_guardrails_are_a_path_relative_to_the_file_that_must_exist(tmp_path: Path) -> None:
    f = tmp_path / "k.yaml"
    f.write_text("zones: [{name: a}, {name: b, router: {guardrails: rules}}]\n")
    with pytest.raises(ConfigError, match=r"^zones\[1\]\.router\.guardrails: .*rules does not exist"):
        load(f)
    (tmp_path / "rules").mkdir()  # a directory of rule files
    zones = load(f).zones
    assert (zones[0].router.guardrails, zones[1].router.guardrails) == ("", str(tmp_path / "rules"))


def test_the_examples_parse() -> None:
    two = load(EXAMPLES / "kvmesh-two-zones-vllm.yaml")
    assert [z.name for z in two.zones] == ["zone-a", "zone-b"]
    assert {z.worker.engine for z in two.zones} == {"vllm"} and two.zones[1].router.http_port == 8100
    one = load(EXAMPLES / "kvmesh-one-zone-sim.yaml")
    assert one == parse(None)  # the one-zone example spells out the defaults


@pytest.mark.parametrize(
    ("raw", "message"),
    [
        (
            {"zones": [{"name": "a"}, {"name": "b", "worker": {"replicas": "two"}}]},
            "zones[1].worker.replicas: expected int, got str 'two'",
        ),
        ({"router": {"httpPort": True}}, "router.httpPort: expected int, got bool True"),
        ({"router": {"httpPort": 70000}}, "router.httpPort: must be <= 65535, got 70000"),
        ({"worker": {"replicas": 0}}, "worker.replicas: must be >= 1, got 0"),
        ({"worker": {"engine": "trt"}}, "worker.engine: must be one of sim, vllm, got 'trt'"),
        ({"worker": {"simSpeed": "fast"}}, "worker.simSpeed: expected float, got str 'fast'"),
        ({"tls": {"enabled": "yes"}}, "tls.enabled: expected bool, got str 'yes'"),
        ({"auth": {"mode": "maybe"}}, "auth.mode: must be one of enforce, auto, off, got 'maybe'"),
        ({"logLevel": "LOUD"}, "logLevel: must be one of DEBUG, INFO, WARNING, ERROR, got 'LOUD'"),
        ({"image": {"tag": "x"}}, "image: unknown key"),
        ({"router": {"replicas": 2}}, "router.replicas: unknown key"),
        ({"zones": [{"name": "a", "gpu": 1}]}, "zones[0].gpu: unknown key"),
        ({"zones": [{"name": "a", "worker": {"count": 1}}]}, "zones[0].worker.count: unknown key"),
        ({"zones": [{"worker": {}}]}, "zones[0].name: missing"),
        ({"zones": [{"name": "A_1"}]}, "zones[0].name: a zone name is lower-case"),
        ({"zones": [{"name": "a"}, {"name": "a"}]}, "zones[1].name: zone 'a' is listed twice"),
        ({"zones": []}, "zones: expected a non-empty list"),
        ({"zones": {"a": 1}}, "zones: expected a non-empty list, got mapping"),
        ({"zones": ["a"]}, "zones[0]: expected a mapping, got str"),
        ({"zone": "a", "zones": [{"name": "a"}]}, "zone: give either zone"),
        ({"worker": 3}, "worker: expected a mapping, got int"),
        ({"router": {"profile": 3}}, "router.profile: expected a file path or a profile mapping, got int"),
        ({"router": {"grpcPort": 50052}}, "router.grpcPort: port 50052 of router gRPC of zone local is also"),
        ({"worker": {"grpcPort": 65535}}, "worker.grpcPort + 1: worker gRPC 1 of zone local would be port 65536"),
        ([1, 2], "the file must be a mapping, got list"),
        (
            {**TWO, "ports": {"zoneStride": 1000}},
            "zones[1].cacheManager.grpcPort: port 51052 of cache-manager gRPC of zone b is also cache-manager HTTP",
        ),
    ],
)
def test_a_bad_file_names_the_key(raw: Any, message: str) -> None:
    assert _error(raw).startswith(message)


def test_bad_set_and_bad_yaml_name_what_is_wrong(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match=r"^--set: expected KEY=VALUE"):
        load(None, ["worker.replicas"])
    with pytest.raises(ConfigError, match=r"^zones\[3\]: no such list item"):
        load(None, ["zones=[{name: a}]", "zones[3].worker.replicas=1"])
    with pytest.raises(ConfigError, match=r"^worker\.\.x: not a key path"):
        load(None, ["worker..x=1"])
    with pytest.raises(ConfigError, match=r"^worker\.replicas: expected int, got str"):
        load(None, ["worker.replicas=two"])
    bad = tmp_path / "bad.yaml"
    bad.write_text("worker: [\n")
    with pytest.raises(ConfigError, match="is not YAML"):
        load(bad)
    with pytest.raises(ConfigError, match="cannot read"):
        load(tmp_path / "missing.yaml")
