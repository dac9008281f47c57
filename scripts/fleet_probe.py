"""Single fleet-simulator probes: one policy, one trace window, one load scale (or a capacity bisection).

    python scripts/fleet_probe.py --policy kvmesh [--profile P.yaml] --window 1800:2700 --scale 0.5
    python scripts/fleet_probe.py --policy llm_d --window 0:900 --bisect
    python scripts/fleet_probe.py --policy kvmesh --window full --scale 0.2410 --no-stop
    python scripts/fleet_probe.py --policy kvmesh --window 0:900 --scale 1.0905 --no-stop --data-plane
    python scripts/fleet_probe.py --policy kvmesh --window 0:900 --scale 1.5 --data-plane --free-cache

Same fleet and SLO as ``python -m kvmesh.bench fleet`` (16 workers, block 512, seed 0 unless ``--seed``,
excess-TTFT p99 ≤ 2 s, ITL p99 ≤ 100 ms); ``--bisect`` is the benchmark's bisection (start 0.5, 5 % tolerance,
≤ 10 probes) on the window. ``--data-plane``: the bench's ``--data-plane --cpu-tier-gb G`` (default 256);
``--free-cache`` (with it): a bound, 10⁶ GB of CPU tier per worker and free links (10¹⁵ B/s, RTT 0), so every
block ever computed anywhere is a free hit for a policy that pulls. Prints one JSON line per probe. Bound the
run with ``timeout`` (single process, no pool).
"""

from __future__ import annotations

import argparse
import json
import sys
import time

from kvmesh.engine.sim.perf import LinkModel
from kvmesh.fleet.capacity import bisect_capacity
from kvmesh.fleet.policies import make_policy
from kvmesh.fleet.readers import read_trace
from kvmesh.fleet.sim import FleetConfig, FleetSim, HashCache
from kvmesh.fleet.tiers import DataPlane

TRACE = "/work/shared/traces/mooncake_conversation_trace.jsonl"


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--trace", default=TRACE)
    p.add_argument("--policy", default="kvmesh")
    p.add_argument("--profile", default=None, help="YAML profile for kvmesh")
    p.add_argument("--window", default="0:900", help="t0:t1 seconds of trace time, or 'full'")
    p.add_argument("--scale", type=float, default=0.5)
    p.add_argument("--bisect", action="store_true")
    p.add_argument(
        "--no-stop", action="store_true", help="run to the end (full metrics) instead of stopping once the SLO is lost"
    )
    p.add_argument("--workers", type=int, default=16)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--data-plane", action="store_true", help="CPU tier on every worker, peer pulls for kvmesh")
    p.add_argument("--cpu-tier-gb", type=float, default=256.0)
    p.add_argument("--free-cache", action="store_true", help="with --data-plane: unbounded tier, free links")
    a = p.parse_args()
    dp = DataPlane(a.cpu_tier_gb) if a.data_plane else None
    if dp is not None and a.free_cache:
        dp = DataPlane(1e6, links=LinkModel(1e15, 1e15, 0.0, 1e15))
    tr = read_trace(a.trace)
    if a.window != "full":
        t0, t1 = (float(x) for x in a.window.split(":"))
        tr = tr.window(t0, t1)
    hc = HashCache(tr, FleetConfig().block_size)

    def run(scale: float) -> bool:
        cfg = FleetConfig(
            workers=a.workers, seed=a.seed, load_scale=scale, stop_when_slo_lost=not a.no_stop, data_plane=dp
        )
        t = time.perf_counter()
        r = FleetSim(tr, make_policy(a.policy, a.profile), cfg, hc).run()
        s = r.summary
        ok = bool(s.get("meets_slo")) and not r.truncated
        out = {
            "policy": a.policy,
            "profile": a.profile,
            "window": a.window,
            "seed": a.seed,
            "scale": round(scale, 4),
            "meets": ok,
            "stopped": r.stopped_early,
            "n": len(tr),
            "excess_p99_ms": round(s.get("ttft_over_allowance_ms_p99", float("nan")), 1),
            "itl_p99_ms": round(s.get("itl_ms", {}).get("p99", float("nan")), 1),
            "ttft_p99_ms": round(s.get("ttft_ms", {}).get("p99", float("nan")), 1),
            "hit": round(s.get("hit_ratio", float("nan")), 4),
            "goodput": round(s.get("goodput", float("nan")), 4),
            "unfinished": s.get("unfinished"),
            "pulled_blocks": s.get("data_plane", {}).get("pulled_blocks"),
            "wall_s": round(time.perf_counter() - t, 1),
        }
        print(json.dumps(out), flush=True)
        return ok

    if a.bisect:
        cap = bisect_capacity(run, start=0.5, rel_tol=0.05, max_iter=10)
        print(
            json.dumps(
                {
                    "policy": a.policy,
                    "profile": a.profile,
                    "window": a.window,
                    "slo_capacity": round(cap.value, 4),
                    "upper": round(cap.upper, 4),
                    "probes": [(round(s, 3), ok) for s, ok in cap.probes],
                }
            ),
            flush=True,
        )
    else:
        run(a.scale)
    return 0


if __name__ == "__main__":
    sys.exit(main())
