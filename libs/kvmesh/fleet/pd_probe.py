"""``python -m kvmesh.fleet.pd_probe --trace PATH --window 0:900 --scale 1.2 [--split 12 --decider kvmesh]``:
single fleet probes, aggregated or P/D, run to the end (full metrics), one JSON line each.

Same fleet and SLO as ``python -m kvmesh.bench fleet --data-plane --pd`` (16 workers, block 512, 256 GB CPU
tier, TTFT allowance at chunk 1024). ``--budget B/C``: the (decode) engines' step budget and chunk
(default 8192/1024). ``--split X``: X prefill workers under ``--decider`` (omit: aggregated, kvmesh).
``--link-gbps``: the handoff NIC; ``--free-handoff``: a bound, a link of 10⁹ Gb/s and no round trip (the
handoff costs nothing, its queueing neither). ``--scales``: several loads, one line each. Bound the run with
``timeout``: one process, no pool.
"""

from __future__ import annotations

import argparse
import json
import time
from dataclasses import replace

from kvmesh.fleet.pd import PD_DECIDERS, PD_ROUTING, PdFleet
from kvmesh.fleet.pd_eval import ALLOWANCE_CHUNK
from kvmesh.fleet.policies import make_policy
from kvmesh.fleet.readers import read_trace
from kvmesh.fleet.sim import FleetConfig, FleetSim, HashCache
from kvmesh.fleet.tiers import DataPlane


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m kvmesh.fleet.pd_probe", description=__doc__.splitlines()[0])
    p.add_argument("--trace", required=True)
    p.add_argument("--window", default="0:900", help="t0:t1 seconds of trace time, or 'full'")
    p.add_argument("--scales", required=True, help="comma list of load scales")
    p.add_argument("--workers", type=int, default=16)
    p.add_argument("--budget", default="8192/1024", help="engines' step budget / chunk")
    p.add_argument("--split", type=int, default=None, help="prefill workers (omit: aggregated)")
    p.add_argument("--decider", default="kvmesh", choices=PD_DECIDERS)
    p.add_argument("--link-gbps", type=float, default=100.0)
    p.add_argument("--free-handoff", action="store_true")
    p.add_argument("--no-data-plane", action="store_true")
    a = p.parse_args(argv)
    tr = read_trace(a.trace)
    if a.window != "full":
        t0, t1 = (float(x) for x in a.window.split(":"))
        tr = tr.window(t0, t1)
    b, c = (int(x) for x in a.budget.split("/"))
    base = FleetConfig(
        workers=a.workers,
        max_batched_tokens=b,
        prefill_chunk_tokens=c,
        allowance_chunk_tokens=ALLOWANCE_CHUNK,
        data_plane=None if a.no_data_plane else DataPlane(256.0),
    )
    policy = "kvmesh"
    if a.split is not None:
        pd = PdFleet(a.split, a.decider, 1e9 if a.free_handoff else a.link_gbps, 0.0 if a.free_handoff else 1e-3)
        base = replace(base, pd=pd)
        policy = PD_ROUTING[a.decider]
    hc = HashCache(tr, base.block_size)
    for scale in (float(x) for x in a.scales.split(",")):
        t = time.perf_counter()
        s = FleetSim(tr, make_policy(policy), replace(base, load_scale=scale), hc).run().summary
        pd_s = s.get("pd", {})
        out = {
            "trace": a.trace,
            "window": a.window,
            "budget": a.budget,
            "split": pd_s.get("split", "aggregated"),
            "decider": pd_s.get("decider"),
            "link_gbps": pd_s.get("link_gbps"),
            "scale": scale,
            "meets": s.get("meets_slo"),
            "ttft_over_allowance_p99_ms": round(s.get("ttft_over_allowance_ms_p99", float("nan"))),
            "itl_p99_ms": round(s.get("itl_ms", {}).get("p99", float("nan")), 1),
            "hit": round(s.get("hit_ratio", float("nan")), 4),
            "unfinished": s.get("unfinished"),
            "disagg_share": round(pd_s.get("disagg_share", 0.0), 3),
            "handoff_ms": {k: round(v) for k, v in pd_s.get("handoff_ms", {}).items()},
            "reasons": pd_s.get("reasons"),
            "wall_s": round(time.perf_counter() - t, 1),
        }
        print(json.dumps(out), flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
