"""Live replay of the Mooncake trace against a real suite agrees with the fleet simulator (the fleet evaluation).

A real cache-manager, 4 simulated workers (``--sim-speed 4``, the simulator's engine settings and KV capacity)
and a router with the default profile run on loopback; the first 150 requests of the Mooncake conversation
trace are replayed over gRPC at 4× speed with arrivals stretched 4× (``load_scale`` 0.25: 54 s of trace →
216 s simulated → ≈ 57 s wall), and the simulator runs the same slice on the same fleet under the same
profile (``kvmesh.fleet.live``, ``kvmesh.bench.fleet_live``).

Tolerance, and why (measured figures in docs/live-replay.md):

* every request completes without an error, in both (exact: nothing in the suite may drop a request);
* the client kept time: no request was sent more than 1 s wall late (else the figures are the client's);
* hit ratio within ±0.02 absolute (measured: 0.000–0.001): the same pipeline routes over the same cache
  contents, but the live router sees load reports up to 50 ms wall (200 ms simulated) old and the index a
  few ms late, so a few placements, and with them a few hits, may differ (this slice reuses little, ≈ 0.035);
* TTFT p50 and p90, ITL p50 and e2e p50 within a factor 2 either way. The fidelity figure is 1.25 (measured
  on a quiet machine: TTFT 0.95–1.06, ITL 1.02–1.05, e2e 0.99–1.07) and belongs to the benchmark
  (`python -m kvmesh.bench fleet-live`, docs/live-replay.md): with both cores busy under other work (a
  loaded CI run: ITL 1.28, a send lagging 169 ms) the live side runs on less CPU than the simulator
  models, which no test can rule out. A factor 2 still catches a broken model or engine driver (before
  the deadline-scheduling change live ITL was 1.35–1.8×). The fleet is ≈ 90 % busy: TTFT is mostly
  queueing, and queueing amplifies every difference in placement (per-worker counts differ by a few
  requests); the simulated workers' clocks run at S × wall time, so OS scheduling jitter on the shared
  cores is multiplied by S. Tails (p99, and ITL p90, 1.25–1.6 live/sim: a few requests decoding next to
  different prefills) are not asserted.

S = 4 keeps the test near one minute and the suite at ≈ 25 % of the 2 cores. The worker's engine driver
schedules steps on absolute deadlines, which absorbs its per-step CPU time (≈ 2.5 ms wall with 16 streams)
as long as a step lasts longer than that in wall time (31 ms / S); before that change every step was that
much longer in simulated time and live ITL was 1.35–1.8× the simulator's at S = 2–8.
"""

from __future__ import annotations

import os
import time
from pathlib import Path

import pytest

from kvmesh.bench.fleet_live import local_suite, simulate
from kvmesh.bench.process_cpu import cpu_seconds
from kvmesh.fleet.live import LiveConfig, agreement, replay
from kvmesh.fleet.readers import read_trace

pytestmark = [pytest.mark.integration, pytest.mark.slow, pytest.mark.timeout(240)]
TRACE = Path(__file__).resolve().parents[4] / "shared" / "traces" / "mooncake_conversation_trace.jsonl"
WORKERS, SPEED, LOAD_SCALE, REQUESTS = 4, 4.0, 0.25, 150


def within(x: float, lo: float, hi: float) -> bool:
    return lo <= x <= hi


async def test_live_replay_agrees_with_the_simulator(tmp_path: Path) -> None:
    trace = read_trace(TRACE, limit=REQUESTS)
    sim = simulate(trace, WORKERS, 512, None, LOAD_SCALE)
    cfg = LiveConfig(speed=SPEED, load_scale=LOAD_SCALE, max_wall_s=150.0)
    with local_suite(tmp_path, WORKERS, SPEED) as suite:
        pids = [sp.proc.pid for sp in suite.procs]
        c0, t0 = cpu_seconds(pids), time.monotonic()
        res = await replay(trace, suite.router.address, cfg)
        share = (cpu_seconds(pids) - c0) / ((time.monotonic() - t0) * (os.cpu_count() or 1))
    live = res.summary
    agree = agreement(live, sim)
    print(f"suite cpu share {share:.2f}; agreement {agree}")  # shown with -s / on failure
    ctx = f"cpu share {share:.2f}, agreement {agree}, live {live}"
    assert not res.truncated and live["errors"] == 0, ctx
    assert live["requests"] == sim["requests"] == REQUESTS, ctx
    assert live["send_lag_ms_max"] < 1000, ctx
    assert abs(agree["hit_ratio_diff"]) <= 0.02, ctx
    for key, p in (("ttft_ms", "p50"), ("ttft_ms", "p90"), ("itl_ms", "p50"), ("e2e_ms", "p50")):
        assert within(agree[f"{key}_ratio"][p], 1 / 2, 2), f"{key} {p}: {ctx}"
