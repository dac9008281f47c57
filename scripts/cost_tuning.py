"""Choose the default ``cost`` scorer's weights on several workloads, with one workload held out.

    python scripts/cost_tuning.py [--jobs 2] [--workloads W,...] [--candidates C,...] [--out FILE.json]

Every (workload, policy) pair gets the benchmark's capacity bisection (``kvmesh.fleet.capacity``: start 0.5,
5 % relative tolerance, ≤ 10 probes) with the KV data plane on (256 GB CPU tier per worker, peer pulls for
kvmesh), 16 workers, seed 0, the bench's SLO. Candidates are the ``cost`` scorer's parameters on top of the
default profile (:data:`CANDIDATES`); ``dynamo`` and ``llm_d`` are run on the same workloads as the bar. A
candidate's score on a workload is its capacity over the better of the two; the choice is the candidate
with the highest *minimum* score over the tuning workloads (geometric mean breaks ties); the held-out
workload takes no part in the choice and is reported beside it. Prints one JSON line per bisection and a
final summary line.

Workloads (:data:`WORKLOADS`): ``tune`` ones are the development trace's window 1800–2700 s (not the bench's
0–900 s bisection window), three synthetic generators of ``kvmesh.fleet.synthetic`` with different sharing
and length mixes, and the Azure conversation trace's lengths (0–900 s; no reuse: pure load balancing);
``check`` is the held-out Poisson-conversation trace (``python -m kvmesh.fleet.gen_trace --seed 0``, 0–900 s).
Bound the run with ``timeout``.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import tempfile
import time
from collections.abc import Callable
from concurrent.futures import ProcessPoolExecutor
from importlib import resources
from pathlib import Path
from typing import Any

import yaml

from kvmesh.fleet import synthetic
from kvmesh.fleet.capacity import bisect_capacity
from kvmesh.fleet.policies import make_policy
from kvmesh.fleet.readers import read_trace, write_mooncake
from kvmesh.fleet.sim import FleetConfig, FleetSim, HashCache
from kvmesh.fleet.tiers import DataPlane
from kvmesh.fleet.trace import Trace

TRACES = Path("/work/shared/traces")
REFERENCES = ("dynamo", "llm_d")


def _file(name: str, t0: float, t1: float) -> Callable[[], Trace]:
    return lambda: read_trace(str(TRACES / name)).window(t0, t1)


def _held_out() -> Trace:
    """The bench's held-out input exactly: the generator's trace through its JSONL file (arrivals in
    integer ms, as ``python -m kvmesh.fleet.gen_trace`` writes them), then the window."""
    with tempfile.TemporaryDirectory() as folder:
        path = Path(folder) / "held-out.jsonl"
        write_mooncake(synthetic.poisson_conversations(seed=0), path)
        return read_trace(path).window(0.0, 900.0)


# name -> (role, builder)
WORKLOADS: dict[str, tuple[str, Callable[[], Trace]]] = {
    "mooncake-1800-2700": ("tune", _file("mooncake_conversation_trace.jsonl", 1800.0, 2700.0)),
    "shared-prefix": ("tune", lambda: synthetic.shared_prefix_tenants(seed=0)),
    "long-context": ("tune", lambda: synthetic.long_context_mix(seed=0)),
    "bursty": ("tune", lambda: synthetic.bursty(seed=0)),
    "azure-0-900": ("tune", _file("AzureLLMInferenceTrace_conv.csv", 0.0, 900.0)),
    "held-out": ("check", _held_out),
}

# name -> cost-scorer params over the default profile's (alpha = prefill/(prefill+decode))
CANDIDATES: dict[str, dict[str, float]] = {
    "a0.9-g10-k8-e0.25": {"interference_floor": 0},  # the default before this study (the fleet evaluation)
    "a0.9-g10-k8-e0": {"interference_weight": 0.0},
    "a0.9-g20-k8-e0": {"interference_weight": 0.0, "itl_weight": 20},
    "a0.8-g20-k8-e0": {"interference_weight": 0.0, "itl_weight": 20, "prefill_weight": 0.8, "decode_weight": 0.2},
    # E counts only the prefill beyond one engine step's token budget (max_batched_tokens = 8192, 4096)
    "a0.9-g10-k8-e0.25-f8192": {"interference_floor": 8192},
    "a0.9-g10-k8-e0.25-f4096": {"interference_floor": 4096},
}


def _profile_file(params: dict[str, float], folder: str) -> str | None:
    if not params:
        return None
    prof = yaml.safe_load(resources.files("kvmesh.routing").joinpath("default_profile.yaml").read_text())
    cost = next(s for s in prof["scorers"] if s["type"] == "cost")
    cost["params"].update(params)
    path = Path(folder) / (json.dumps(params, sort_keys=True).encode().hex()[:40] + ".yaml")
    path.write_text(yaml.safe_dump(prof))
    return str(path)


def bisect_one(workload: str, policy: str, params: dict[str, float] | None) -> dict[str, Any]:
    """Capacity of ``policy`` (``kvmesh`` with ``params``, or a reference) on ``workload``."""
    trace = WORKLOADS[workload][1]()
    hc = HashCache(trace, FleetConfig().block_size)
    dp = DataPlane(256.0)
    started = time.perf_counter()
    with tempfile.TemporaryDirectory() as folder:
        profile = _profile_file(params or {}, folder) if policy == "kvmesh" else None

        def meets(scale: float) -> bool:
            cfg = FleetConfig(workers=16, seed=0, load_scale=scale, stop_when_slo_lost=True, data_plane=dp)
            res = FleetSim(trace, make_policy(policy, profile), cfg, hc).run()
            return bool(res.summary.get("meets_slo")) and not res.truncated

        cap = bisect_capacity(meets, start=0.5, rel_tol=0.05, max_iter=10)
    return {
        "workload": workload,
        "policy": policy,
        "params": params,
        "requests": len(trace),
        "slo_capacity": round(cap.value, 4),
        "probes": [(round(s, 3), ok) for s, ok in cap.probes],
        "wall_s": round(time.perf_counter() - started, 1),
    }


def summarise(rows: list[dict[str, Any]], candidates: list[str]) -> dict[str, Any]:
    """Per candidate: its capacity ÷ the best reference's on each workload; the choice by min then geomean."""
    bar: dict[str, float] = {}
    cap: dict[tuple[str, str], float] = {}
    for r in rows:
        if r["policy"] in REFERENCES:
            bar[r["workload"]] = max(bar.get(r["workload"], 0.0), r["slo_capacity"])
        else:
            cap[(r["candidate"], r["workload"])] = r["slo_capacity"]
    table: dict[str, dict[str, float]] = {}
    for c in candidates:
        table[c] = {w: round(cap[(c, w)] / bar[w], 3) for (cc, w) in cap if cc == c and bar.get(w)}
    tuning = [w for w, (role, _) in WORKLOADS.items() if role == "tune"]

    def rank(c: str) -> tuple[float, float]:
        xs = [table[c].get(w, 0.0) for w in tuning]
        return (min(xs), math.exp(sum(math.log(max(x, 1e-9)) for x in xs) / len(xs)))

    chosen = max(candidates, key=rank)
    return {"bar": bar, "ratio_to_best_reference": table, "chosen": chosen, "chosen_rank": rank(chosen)}


def _reused(path: str, jobs: list[tuple[str, str, str | None]]) -> list[dict[str, Any]]:
    """Rows of an earlier run that answer one of `jobs` with the same parameters."""
    wanted = {(w, pol, c): (CANDIDATES[c] if c else None) for w, pol, c in jobs}
    rows = []
    for line in Path(path).read_text().splitlines():
        row = json.loads(line) if line.startswith("{") else {}
        key = (row.get("workload"), row.get("policy"), row.get("candidate"))
        if key in wanted and row.get("params") == wanted[key]:
            rows.append(row)
    return rows


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--jobs", type=int, default=2)
    p.add_argument("--workloads", default=",".join(WORKLOADS))
    p.add_argument("--candidates", default=",".join(CANDIDATES))
    p.add_argument("--out", default=None, help="also write every row and the summary here (JSON)")
    p.add_argument("--reuse", default=None, help="JSON lines of an earlier run: its bisections are not rerun")
    a = p.parse_args(argv)
    workloads = a.workloads.split(",")
    candidates = a.candidates.split(",")
    jobs: list[tuple[str, str, str | None]] = [(w, ref, None) for w in workloads for ref in REFERENCES]
    jobs += [(w, "kvmesh", c) for w in workloads for c in candidates]
    rows = _reused(a.reuse, jobs) if a.reuse else []
    done = {(r["workload"], r["policy"], r["candidate"]) for r in rows}
    jobs = [j for j in jobs if j not in done]
    with ProcessPoolExecutor(max_workers=a.jobs) as pool:
        futs = [(c, pool.submit(bisect_one, w, pol, CANDIDATES[c] if c else None)) for w, pol, c in jobs]
        for c, fut in futs:
            row = fut.result()
            row["candidate"] = c
            rows.append(row)
            print(json.dumps(row), flush=True)
    summary = summarise(rows, candidates)
    print(json.dumps({"summary": summary}), flush=True)
    if a.out:
        Path(a.out).write_text(json.dumps({"rows": rows, "summary": summary}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
