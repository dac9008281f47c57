"""The failover benchmark, shortened: a zone dies (processes + link) under client traffic, then returns.

Runs ``python -m kvmesh.bench failover`` as a real process (namespaces, real services, Consul stand-in)
and checks on its JSON line: no request lost or duplicated, every client stopped sending to the dead zone
while it was down (its switchover shorter than the outage), and traffic flows back to the restored zone. The
switchover figure itself (the design's 3 s bar) is the benchmark's to print (docs/benchmarks.md, Failover): on
2 shared cores its tail follows the machine's load, so it is not a pass/fail threshold here.
"""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from kvmesh.bench import netns
from tests.consul_standin.launch import REPO

pytestmark = [pytest.mark.fault, pytest.mark.slow]


@pytest.mark.parametrize("scenario", ["zone", "consul"])
def test_zone_kill_loses_no_request(scenario: str) -> None:
    reason = netns.available()
    if reason:
        pytest.skip(reason)
    extra = ["--consul-stop-s", "8"] if scenario == "consul" else []
    out = subprocess.run(
        [
            sys.executable,
            "-m",
            "kvmesh.bench",
            "failover",
            "--zones",
            "2",
            "--workers-per-zone",
            "1",
            "--duration",
            "32",
            "--clients",
            "3",
            "--scenario",
            scenario,
            *extra,
        ],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=240,
        check=False,
    )
    assert out.returncode == 0, out.stderr[-3000:]
    r = json.loads(out.stdout.strip().splitlines()[-1])
    assert r["requests_total"] > 20
    assert r["requests_lost"] == 0, r["errors"]
    assert r["requests_duplicated"] == 0
    print("switchover_s", r["switchover_s"], "outage_s", r["outage_s"])
    assert r["switchover_s"]["max"] < r["outage_s"]
    assert r["failback_s"] is not None
