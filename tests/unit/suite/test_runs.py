"""A suite's runs (`kvmesh.suite.runs`): the state file from the first spawned process on, the progress `up`
prints, one directory per run (`down` keeps the last one), the logs of a run, and stopping processes with real
signals."""

from __future__ import annotations

import io
import json
import subprocess
import sys
from pathlib import Path

import pytest

from kvmesh.suite import runs
from kvmesh.suite.launcher import ServiceProcess

pytestmark = pytest.mark.unit


@pytest.fixture
def home(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> Path:
    monkeypatch.setenv("KVMESH_HOME", str(tmp_path))
    (tmp_path / "run").mkdir()
    return tmp_path


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def _sleeper() -> subprocess.Popen[bytes]:
    """A process that ends on SIGTERM (as a service does), in its own session (as services run)."""
    return subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"], start_new_session=True)


def test_the_state_file_knows_every_process_from_its_spawn(home: Path) -> None:
    clock, out = Clock(), io.StringIO()
    run = runs.open_run()
    state = home / "run" / "suite.json"
    progress = runs.StartProgress(state, run, out, clock)
    doc = json.loads(state.read_text())
    assert (doc["state"], doc["services"], doc["starting"]) == ("starting", [], [])
    assert runs.alive(doc["launcher_pid"])
    progress.provisioned({"tokens": {"admin": "a.token"}, "tls": None})
    procs = [_sleeper(), _sleeper()]
    try:
        cm = ServiceProcess("cache-manager", procs[0], run / "x.ready.json", run / "logs" / "cm.log")
        worker = ServiceProcess("worker", procs[1], run / "y.ready.json", run / "logs" / "w.log")
        progress.spawned(cm, ["--zone", "a", "--block-size", "32"])
        progress.spawned(worker, ["--zone", "a", "--service-id", "worker-a-0", "--engine", "vllm"])
        doc = json.loads(state.read_text())
        assert [(s["label"], s["zone"], s["pid"]) for s in doc["starting"]] == [
            ("cache-manager-a", "a", procs[0].pid),
            ("worker-a-0", "a", procs[1].pid),
        ]
        assert doc["auth"]["tokens"]["admin"] == "a.token"
        clock.now += 4.2
        cm.info = {"id": "cache-manager-a-1", "grpc": "127.0.0.1:1", "http_port": 2, "zone": "a"}
        progress.ready(cm)
        doc = json.loads(state.read_text())
        assert [s["id"] for s in doc["services"]] == ["cache-manager-a-1"] and len(doc["starting"]) == 1
        assert out.getvalue().split() == [
            "ready",
            "cache-manager",
            "cache-manager-a-1",
            "grpc",
            "127.0.0.1:1",
            "(4.2s)",
        ]
        clock.now += 20
        assert progress.waiting() == (
            f"  ...    waiting 24s for worker-a-0 (vLLM engines loading); its log: {run / 'logs' / 'w.log'}"
        )
        progress.abort()  # `kvmesh down` while starting: every spawned process is killed
        assert procs[0].wait(timeout=10) != 0 and procs[1].wait(timeout=10) != 0
        late = _sleeper()
        procs.append(late)
        progress.spawned(ServiceProcess("router", late, run / "z", run / "logs" / "r.log"), ["--zone", "a"])
        assert late.wait(timeout=10) != 0  # spawned after the abort: killed at once
        progress.finish({"services": doc["services"]})
        assert json.loads(state.read_text())["state"] == "running"
        progress.abandon()
        assert not state.exists()
    finally:
        for p in procs:
            p.kill()
            p.wait(timeout=10)


def test_down_closes_the_run_and_up_opens_a_fresh_one(home: Path) -> None:
    first = runs.open_run()
    (first / "planner-history-a.json").write_text("{}")
    (first / "logs").mkdir()
    last = runs.close_run({"services": [], "state": "running"})
    assert last == home / "run" / "last" and not first.exists()
    assert (last / "planner-history-a.json").exists() and json.loads((last / "suite.json").read_text())[
        "services"
    ] == []
    second = runs.open_run()
    assert second == first and list(second.iterdir()) == []  # nothing of the first run's
    (second / "left-over").write_text("")
    third = runs.open_run()  # a run that ended without `down` is closed first: it becomes the last
    assert (home / "run" / "last" / "left-over").exists() and list(third.iterdir()) == []
    runs.discard_run()
    assert not third.exists() and (home / "run" / "last" / "left-over").exists()


def test_log_entries_by_service_id_and_zone_in_a_closed_run(tmp_path: Path) -> None:
    state = {
        "services": [
            {"name": "router", "id": "router-a-1", "zone": "a", "log": "/old/current/logs/router-1.log"},
            {"name": "router", "id": "router-b-2", "zone": "b", "log": "/old/current/logs/router-2.log"},
            {"name": "worker", "id": "worker-b-0", "zone": "b", "log": "/old/current/logs/worker-3.log"},
        ],
        "starting": [{"name": "planner", "label": "planner-b", "zone": "b", "log": "/old/current/logs/planner-4.log"}],
    }
    logs = tmp_path / "logs"
    assert runs.log_entries(state, tmp_path, "router", "") == [
        ("router-a-1", logs / "router-1.log"),
        ("router-b-2", logs / "router-2.log"),
    ]
    assert runs.log_entries(state, tmp_path, "", "b") == [
        ("router-b-2", logs / "router-2.log"),
        ("worker-b-0", logs / "worker-3.log"),
        ("planner-b", logs / "planner-4.log"),
    ]
    assert runs.log_entries(state, tmp_path, "worker-b-0", "") == [("worker-b-0", logs / "worker-3.log")]
    assert runs.log_entries(state, tmp_path, "nope", "") == []


def test_stop_services_says_each_one_and_how_it_ended() -> None:
    proc = _sleeper()
    gone = _sleeper()
    gone.kill()
    gone.wait(timeout=10)
    out = io.StringIO()
    worst = runs.stop_services(
        [{"name": "router", "id": "router-a-1", "pid": proc.pid}, {"name": "worker", "label": "w", "pid": gone.pid}],
        out,
    )
    lines = out.getvalue().splitlines()
    assert lines[0].split()[:5] == ["stopping", "router", "router-a-1", "pid", str(proc.pid)]
    assert " exited -15 (" in lines[0] or " stopped (" in lines[0], lines[0]  # SIGTERM: our child's code is known
    assert lines[1].split()[:5] == ["stopping", "worker", "w", "pid", str(gone.pid)] and "already gone" in lines[1]
    assert proc.poll() is not None and worst in (0, -15)
