"""Prefill/decode pools in the local suite's settings: `--prefill-workers N --decode-workers M`, the same keys in
the config file per zone, the roles and flags each worker is started with, the registry's `worker_role`, and
one clear error per bad value, naming the flag or key it came from."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from kvmesh.core.handoff import WorkerRole
from kvmesh.discovery.model import WORKER_ROLE_META, CatalogSnapshot
from kvmesh.suite import cli, local, observe
from kvmesh.suite.config import ConfigError, load, parse, plan
from kvmesh.suite.launcher import ServiceProcess

pytestmark = [pytest.mark.unit]

P, D, B = WorkerRole.PREFILL, WorkerRole.DECODE, WorkerRole.BOTH


def _up(capsys: pytest.CaptureFixture[str], tmp_path: Path, *argv: str) -> tuple[int, str]:
    """`kvmesh up ARGV` parsed and run up to its settings (a bad value stops it there, before anything starts)."""
    args = cli.build_parser().parse_args(["up", *argv])
    code = cli.up(args)
    return code, capsys.readouterr().err.strip()


def test_pools_replace_replicas_and_order_the_roles() -> None:
    (z,) = parse({"worker": {"prefillReplicas": 1, "decodeReplicas": 2}}).zones
    assert (z.worker.replicas, z.worker.roles(), z.worker.disaggregated) == (3, (P, D, D), True)
    (agg,) = parse(None).zones
    assert (agg.worker.roles(), agg.worker.disaggregated) == ((B, B), False)
    # every worker of both pools gets its ports
    assert {p.port for p in plan(parse({"worker": {"prefillReplicas": 1, "decodeReplicas": 2}}))} >= {
        50060,
        50061,
        50062,
    }


def test_pools_per_zone_in_the_file() -> None:
    s = parse(
        {
            "worker": {"decodeReplicas": 1},
            "zones": [{"name": "a", "worker": {"prefillReplicas": 2}}, {"name": "b"}, {"name": "c", "worker": {}}],
        }
    )
    assert [z.worker.roles() for z in s.zones] == [(P, P, D), (D,), (D,)]


def test_flags_win_over_the_file_and_workers_means_aggregated(tmp_path: Path) -> None:
    f = tmp_path / "k.yaml"
    f.write_text("zones:\n  - {name: a, worker: {prefillReplicas: 2, decodeReplicas: 2}}\n")
    flags = {"worker.prefillReplicas": 1, "worker.decodeReplicas": None}
    assert [z.worker.roles() for z in load(f, (), flags).zones] == [(P, D, D)]
    args = cli.build_parser().parse_args(["up", "--config", str(f), "--workers", "3"])
    assert [z.worker.roles() for z in load(f, (), cli._flag_overrides(args)).zones] == [(B, B, B)]


@pytest.mark.parametrize(
    ("argv", "line"),
    [
        (["--prefill-workers", "-1", "--decode-workers", "1"], "kvmesh up: --prefill-workers: must be >= 0, got -1"),
        (["--prefill-workers", "1", "--decode-workers", "-2"], "kvmesh up: --decode-workers: must be >= 0, got -2"),
        (["--prefill-workers", "2"], "kvmesh up: --prefill-workers: 2 prefill worker(s) and no decode worker"),
        (["--workers", "2", "--decode-workers", "1"], "kvmesh up: --workers: give either --workers N (aggregated)"),
        (["--prefill-workers", "30", "--decode-workers", "30"], "kvmesh up: --prefill-workers: prefill and decode"),
    ],
)
def test_bad_counts_are_one_line_naming_the_flag(
    capsys: pytest.CaptureFixture[str], tmp_path: Path, monkeypatch: pytest.MonkeyPatch, argv: list[str], line: str
) -> None:
    monkeypatch.setenv("KVMESH_HOME", str(tmp_path))
    code, err = _up(capsys, tmp_path, *argv)
    assert code == 2 and err.startswith(line) and "\n" not in err, err
    assert not (tmp_path / "run").exists(), "nothing may start (not even the run directory) on a bad value"


def test_prefill_workers_need_a_cpu_tier() -> None:
    with pytest.raises(ConfigError) as err:
        parse({"zones": [{"name": "a", "worker": {"prefillReplicas": 1, "decodeReplicas": 1, "cpuTierMb": 0}}]})
    assert err.value.path == "zones[0].worker.cpuTierMb" and "CPU tier" in err.value.message
    # decode workers alone (no handoff to make) may run without one
    assert parse({"worker": {"decodeReplicas": 1, "cpuTierMb": 0}}).zones[0].worker.roles() == (D,)


def test_each_worker_is_started_with_its_role_and_a_cpu_tier(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    s = parse({"ports": {"auto": True}, "worker": {"prefillReplicas": 1, "decodeReplicas": 1, "cpuTierMb": 32}})
    z = s.zones[0]
    seen: list[list[str]] = []

    def start_service(name: str, logs: Path, *flags: str, **_: object) -> ServiceProcess:
        seen.append(list(flags))  # the flags `kvmesh-worker` is started with, not a process
        return ServiceProcess(name, None, logs, logs)  # type: ignore[arg-type]

    monkeypatch.setattr(local, "start_service", start_service)
    auth = local.SuiteAuth(tmp_path, [(z.name, z.worker.replicas)], tls=False)
    for i in range(2):
        local._start_worker(s, z, tmp_path, auth, "127.0.0.1:1", i, {})
    roles = [f[f.index("--role") + 1] for f in seen]
    assert roles == ["prefill", "decode"]
    assert all(f[f.index("--cpu-tier-mb") + 1] == "32.0" and "--host-label" in f for f in seen)
    assert local.worker_roles(s) == {"worker-local-0": "prefill", "worker-local-1": "decode"}


def test_the_registry_carries_each_workers_role(tmp_path: Path) -> None:
    procs = []
    for sid, name in (("worker-a-0", "worker"), ("worker-a-1", "worker"), ("router-a", "router")):
        sp = ServiceProcess(name, None, tmp_path, tmp_path)  # type: ignore[arg-type]
        sp.info = {"id": sid, "grpc": "127.0.0.1:7", "http_port": 8, "zone": "a"}
        procs.append(sp)
    path = tmp_path / "registry.yaml"
    local._write_registry(path, procs, {"worker-a-0": "prefill", "worker-a-1": "decode"})
    snap = CatalogSnapshot.from_json(yaml.safe_load(path.read_text())["instances"])
    meta = {i.id: dict(i.meta) for i in snap.instances}
    assert meta["worker-a-0"][WORKER_ROLE_META] == "prefill" and meta["worker-a-1"][WORKER_ROLE_META] == "decode"
    assert WORKER_ROLE_META not in meta["router-a"]


def test_the_suites_prometheus_labels_each_worker_target_with_its_role() -> None:
    state = {
        "services": [
            {"name": "worker", "id": "worker-local-0", "http_port": 9102, "worker_role": "prefill"},
            {"name": "worker", "id": "worker-local-1", "http_port": 9103, "worker_role": "decode"},
            {"name": "router", "id": "router-local", "http_port": 9104},
        ]
    }
    config = observe.scrape_config(state, Path("/r.yaml"), 5)
    jobs = {j["job_name"]: j["static_configs"] for j in config["scrape_configs"]}
    assert [t["labels"].get("worker_role") for t in jobs["worker"]] == ["prefill", "decode"]
    assert "worker_role" not in jobs["router"][0]["labels"]
