"""The length-aware batching window in the fleet simulator against no window (the batching-window study).

    python scripts/batching_eval.py --trace /work/shared/traces/mooncake_conversation_trace.jsonl \\
        --window 0:900 --scale 0.241 --windows off,50/100,100/200,200/200
    python scripts/batching_eval.py --trace /work/shared/traces/AzureLLMInferenceTrace_conv.csv \\
        --window 0:900 --scale 10 --windows off,100/200

Each entry of ``--windows`` is ``off`` or ``QA_MS/GENERATION_MS`` (a request with max_tokens below
``--generation-max-tokens`` is question answering); every run is the same fleet as ``python -m kvmesh.bench
fleet`` (16 workers, block 512, the bench's SLO), one policy (kvmesh by default), run to the end. Prints one
JSON line per window: TTFT p50/p99, ITL p99, goodput, SLO met, mean requests per release. Bound it with
``timeout`` (one process, runs one after another).
"""

from __future__ import annotations

import argparse
import json
import sys
import time

from kvmesh.engine.batching import WindowConfig
from kvmesh.fleet.policies import make_policy
from kvmesh.fleet.readers import read_trace
from kvmesh.fleet.sim import FleetConfig, FleetSim, HashCache


def parse_window(spec: str, generation_max_tokens: int, budget: int) -> WindowConfig | None:
    """``off`` → None; ``QA_MS/GEN_MS`` → a WindowConfig."""
    if spec == "off":
        return None
    qa, gen = (float(x) / 1000.0 for x in spec.split("/"))
    return WindowConfig(qa, gen, generation_max_tokens=generation_max_tokens, token_budget=budget, max_waiting=1024)


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--trace", required=True)
    p.add_argument("--policy", default="kvmesh")
    p.add_argument("--window", default="0:900", help="t0:t1 seconds of trace time, or 'full'")
    p.add_argument("--scale", type=float, default=0.241)
    p.add_argument("--windows", default="off,50/100,100/200,200/200")
    p.add_argument("--generation-max-tokens", type=int, default=256)
    p.add_argument("--token-budget", type=int, default=16384)
    p.add_argument("--workers", type=int, default=16)
    p.add_argument("--seed", type=int, default=0)
    a = p.parse_args()
    tr = read_trace(a.trace)
    if a.window != "full":
        t0, t1 = (float(x) for x in a.window.split(":"))
        tr = tr.window(t0, t1)
    hc = HashCache(tr, FleetConfig().block_size)
    for spec in a.windows.split(","):
        win = parse_window(spec, a.generation_max_tokens, a.token_budget)
        cfg = FleetConfig(workers=a.workers, seed=a.seed, load_scale=a.scale, batching=win)
        t = time.perf_counter()
        r = FleetSim(tr, make_policy(a.policy), cfg, hc).run()
        s = r.summary
        out = {
            "trace": a.trace.rsplit("/", 1)[-1],
            "window": a.window,
            "scale": a.scale,
            "policy": a.policy,
            "batching_ms": spec,
            "token_budget": a.token_budget if win else None,
            "n": len(tr),
            "ttft_p50_ms": round(s["ttft_ms"]["p50"], 1),
            "ttft_p99_ms": round(s["ttft_ms"]["p99"], 1),
            "excess_p99_ms": round(s["ttft_over_allowance_ms_p99"], 1),
            "itl_p99_ms": round(s["itl_ms"]["p99"], 1),
            "goodput": round(s["goodput"], 4),
            "meets_slo": bool(s["meets_slo"]) and not r.truncated,
            "rejected": r.rejected,
            "hit": round(s["hit_ratio"], 4),
            "mean_release": round(s.get("batching", {}).get("mean_release", 0.0), 2),
            "wall_s": round(time.perf_counter() - t, 1),
        }
        print(json.dumps(out), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
