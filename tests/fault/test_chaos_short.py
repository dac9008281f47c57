"""The chaos campaign, short: a fixed seed whose schedule injects every fault kind at least once (a worker,
router, cache-manager, failover service, planner or Redis killed, stopped or terminated and restarted; a
worker restarted as another version, or OOM-killed; the inter-zone link cut, delayed, capped and flapping; a
rogue planner draining a zone; a worker's KV pool filled; a checkpoint store full; a byte of a worker's CPU
tier corrupted; a burst of 10x the rate) under mixed gRPC and HTTP traffic over two zones of real processes.

Runs ``python -m kvmesh.bench chaos`` as a real process (namespaces, real services, the Consul stand-in) and
checks its JSON line: no request lost, answered with other tokens than a fault-free run's, duplicated or left
hanging; no lease, tier slot or shared-memory segment left behind; every service serving and every index
equal to its workers' (and the other zone's copy to it) soon after the last fault; a corrupted block never
delivered, a full checkpoint store refused with a clear code and written again once freed. What broke an invariant is
on the bench's stderr (each request's whole history), shown when the test fails.
"""

from __future__ import annotations

import json
import signal
import subprocess
import sys

import pytest

from kvmesh.bench import netns
from kvmesh.bench.chaos_schedule import KINDS
from tests.consul_standin.launch import REPO

pytestmark = [pytest.mark.fault, pytest.mark.slow]
SEED = 11
DURATION_S = 90


def test_a_short_chaos_campaign_keeps_every_invariant() -> None:
    reason = netns.available()
    if reason:
        pytest.skip(reason)
    cmd = [sys.executable, "-m", "kvmesh.bench", "chaos", "--seed", str(SEED), "--duration-s", str(DURATION_S)]
    cmd += ["--settle-s", "15", "--mean-gap-s", "4", "--rps", "2"]
    proc = subprocess.Popen(cmd, cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        stdout, stderr = proc.communicate(timeout=240)
    except subprocess.TimeoutExpired:
        proc.send_signal(signal.SIGINT)  # the bench's teardown runs on an interrupt: no process or namespace left
        _, stderr = proc.communicate(timeout=60)
        pytest.fail(f"the campaign ran past 240 s:\n{stderr[-4000:]}")
    assert proc.returncode == 0, stderr[-4000:]
    r = json.loads(stdout.strip().splitlines()[-1])
    story = stderr[-6000:]
    assert set(r["faults"]) == set(KINDS) and all(n >= 1 for n in r["faults"].values()), r["faults"]
    assert r["requests"] > 50 and r["succeeded"] == r["requests"], story
    assert (r["lost"], r["wrong_tokens"], r["duplicates"], r["hung"]) == (0, 0, 0, 0), story
    assert r["failed_non_retryable"] == 0 and r["drain_violations"] == 0, story
    assert r["integrity_violations"] == 0 and r["checkpoint_errors"] == [], story
    assert r["leaks"] == {"leases": 0, "slots": 0, "shm": 0, "processes": 0}, (r["shm_left"], r["orphans"])
    assert r["not_serving"] == {}, r["not_serving"]
    assert r["index_converged_s"] is not None, r["index_differences"]
