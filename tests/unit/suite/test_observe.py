"""kvmesh.suite.observe without a server: the scrape config it writes, and its refusals (port in use, no binary)."""

from __future__ import annotations

import socket
from pathlib import Path

import pytest

from kvmesh.core.errors import FailedPrecondition
from kvmesh.suite import observe

pytestmark = pytest.mark.unit

STATE = {
    "services": [
        {"name": "cache-manager", "id": "cache-manager-local", "http_port": 9101},
        {"name": "worker", "id": "worker-local-0", "http_port": 9102},
        {"name": "worker", "id": "worker-local-1", "http_port": 9103},
        {"name": "router", "id": "router-local", "http_port": 9104},
    ]
}


def test_one_job_per_service_kind_one_target_per_instance() -> None:
    cfg = observe.scrape_config(STATE, Path("/rules.yaml"), interval_s=2)
    assert cfg["rule_files"] == ["/rules.yaml"]
    assert cfg["global"] == {"scrape_interval": "2s", "evaluation_interval": "2s"}
    jobs = {j["job_name"]: j["static_configs"] for j in cfg["scrape_configs"]}
    assert set(jobs) == {"cache-manager", "worker", "router"}
    assert [t["targets"] for t in jobs["worker"]] == [["127.0.0.1:9102"], ["127.0.0.1:9103"]]
    assert [t["labels"]["kvmesh_id"] for t in jobs["worker"]] == ["worker-local-0", "worker-local-1"]


def test_port_in_use_is_an_error_naming_port_and_flag(tmp_path: Path) -> None:
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        with pytest.raises(FailedPrecondition, match=rf"port {port} .*--prometheus-port"):
            observe.start(tmp_path, STATE, port=port)


def test_missing_binary_names_the_bootstrap(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PATH", str(tmp_path))
    with pytest.raises(FailedPrecondition, match=r"bootstrap\.sh"):
        observe.start(tmp_path, STATE, port=0)


def test_a_router_of_several_processes_is_scraped_on_each_process_s_own_port() -> None:
    procs = [
        {"id": "router-local-p0", "pid": 1, "process_http_port": 9201},
        {"id": "router-local-p1", "pid": 2, "process_http_port": 9202},
    ]
    state = {"services": [{"name": "router", "id": "router-local", "http_port": 9104, "processes": procs}]}
    (job,) = observe.scrape_config(state, Path("/rules.yaml"), interval_s=2)["scrape_configs"]
    targets = [(t["targets"], t["labels"]["kvmesh_id"]) for t in job["static_configs"]]
    assert targets == [(["127.0.0.1:9201"], "router-local-p0"), (["127.0.0.1:9202"], "router-local-p1")]


def test_a_tls_suite_is_scraped_over_https_with_its_ca() -> None:
    plain = observe.scrape_config(STATE, Path("/rules.yaml"), interval_s=2)["scrape_configs"]
    assert all("scheme" not in job for job in plain)
    tls = {**STATE, "auth": {"tls": {"ca": "/run/pki/ca.pem"}}}
    for job in observe.scrape_config(tls, Path("/rules.yaml"), interval_s=2)["scrape_configs"]:
        assert job["scheme"] == "https" and job["tls_config"] == {"ca_file": "/run/pki/ca.pem"}, job
