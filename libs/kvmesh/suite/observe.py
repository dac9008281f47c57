"""A real local Prometheus for a running suite (`kvmesh up --observe`).

`start(directory, state, port=...)` writes `directory/prometheus.yml`, one scrape job per service of the suite
(`state` is `run/suite.json`: each service's `/metrics` on its HTTP port on loopback, HTTPS verified with the
suite's CA when it runs TLS; `/metrics` is open to anyone in the authorisation table), with
deploy/prometheus/alerts.yaml as its rule file, and starts Debian's `prometheus` (installed by
scripts/bootstrap.sh) on 127.0.0.1:`port`, its data in `directory/data`.
It returns once Prometheus answers `/-/ready`; `stop(pid)` ends it. A missing binary, a port in use or a
Prometheus that exits at start is a `FailedPrecondition` naming the cause.
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import time
import urllib.error
import urllib.request
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

from kvmesh.core.errors import FailedPrecondition
from kvmesh.core.ports import ports_in_use

DEFAULT_PORT = 9090
ALERT_RULES = Path(__file__).resolve().parents[3] / "deploy" / "prometheus" / "alerts.yaml"


@dataclass(frozen=True)
class Prometheus:
    """A started server, as `run/suite.json` records it (`prometheus`)."""

    pid: int
    url: str  # http://127.0.0.1:PORT
    config: str
    log: str


def scrape_config(state: dict[str, Any], rules: Path, interval_s: float) -> dict[str, Any]:
    """prometheus.yml as a dict: a job per service kind, a target per instance (`kvmesh_id` labels it; a worker's
    also `worker_role`, its prefill/decode role, which the dashboard's per-role panels group by)."""
    jobs: dict[str, list[dict[str, Any]]] = {}
    for svc in state["services"]:
        # a router of several processes: each process on its own port (the shared one reaches any of them)
        own = [(p["process_http_port"], p["id"]) for p in svc.get("processes", [])]
        role = {"worker_role": svc["worker_role"]} if "worker_role" in svc else {}
        for port, ident in own or [(svc["http_port"], svc["id"])]:
            target = {"targets": [f"127.0.0.1:{port}"], "labels": {"kvmesh_id": ident, **role}}
            jobs.setdefault(svc["name"], []).append(target)
    interval = f"{max(1, round(interval_s))}s"
    tls = (state.get("auth") or {}).get("tls")  # a --tls suite serves HTTPS only: verified with its CA
    scheme = {"scheme": "https", "tls_config": {"ca_file": tls["ca"]}} if tls else {}
    return {
        "global": {"scrape_interval": interval, "evaluation_interval": interval},
        "rule_files": [str(rules)],
        "scrape_configs": [
            {"job_name": name, "metrics_path": "/metrics", **scheme, "static_configs": targets}
            for name, targets in jobs.items()
        ],
    }


def check_port(port: int) -> None:
    """FailedPrecondition when `port` is taken (`kvmesh up` asks before it starts anything)."""
    if ports_in_use([port]):
        raise FailedPrecondition(f"port {port} for Prometheus is in use (--prometheus-port)")


def start(
    directory: Path,
    state: dict[str, Any],
    *,
    port: int = DEFAULT_PORT,
    rules: Path = ALERT_RULES,
    interval_s: float = 5.0,
    timeout_s: float = 60.0,
) -> Prometheus:
    binary = shutil.which("prometheus")
    if binary is None:
        raise FailedPrecondition("no `prometheus` on PATH: scripts/bootstrap.sh installs Debian's prometheus package")
    if not rules.is_file():
        raise FailedPrecondition(f"alert rules not found: {rules}")
    check_port(port)
    directory.mkdir(parents=True, exist_ok=True)
    config = directory / "prometheus.yml"
    config.write_text(yaml.safe_dump(scrape_config(state, rules, interval_s), sort_keys=False))
    log = directory / "prometheus.log"
    url = f"http://127.0.0.1:{port}"
    with log.open("ab") as out:
        proc = subprocess.Popen(
            [
                binary,
                f"--config.file={config}",
                f"--storage.tsdb.path={directory / 'data'}",
                f"--web.listen-address=127.0.0.1:{port}",
                "--storage.tsdb.retention.time=1d",
            ],
            stdout=out,
            stderr=subprocess.STDOUT,
            start_new_session=True,  # Ctrl-C on `kvmesh up` reaches it through stop(), in order
        )
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            tail = log.read_text(errors="replace")[-2000:]
            raise FailedPrecondition(f"prometheus exited with {proc.returncode} at start; {log}:\n{tail}")
        try:
            with urllib.request.urlopen(f"{url}/-/ready", timeout=2) as reply:
                if reply.status == 200:
                    return Prometheus(proc.pid, url, str(config), str(log))
        except (urllib.error.URLError, OSError):
            pass
        time.sleep(0.2)  # poll interval while Prometheus opens its storage
    proc.kill()
    raise FailedPrecondition(f"prometheus not ready on {url} within {timeout_s:.0f} s; see {log}")


def gone(pid: int) -> bool:
    """No such process, or a zombie (exited; its parent, a detached `kvmesh up`, is gone and init has not
    reaped it yet) every thread of which has exited. The leader turns zombie while its other threads may
    still be exiting and holding the file table: its listening sockets, and the connections the kernel
    queued on them (reset when they close), outlive the leader's "Z"."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    try:
        tasks = list(Path(f"/proc/{pid}/task").iterdir())
        states = [(t / "stat").read_text().rsplit(")", 1)[1].split()[0] for t in tasks]
    except (FileNotFoundError, ProcessLookupError):  # reaped, or a thread went between listing and read
        return not Path(f"/proc/{pid}").exists()
    except (OSError, IndexError):
        return True
    return all(state == "Z" for state in states)


def stop(pid: int, timeout_s: float = 30.0) -> None:
    """SIGTERM, wait (bounded), then SIGKILL; a process already gone is fine."""
    try:
        os.kill(pid, signal.SIGTERM)
    except ProcessLookupError:
        return
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            done, _ = os.waitpid(pid, os.WNOHANG)
        except ChildProcessError:  # started by another `kvmesh up` process: poll for existence
            if gone(pid):
                return
            done = 0
        if done:
            return
        time.sleep(0.05)
    os.kill(pid, signal.SIGKILL)
