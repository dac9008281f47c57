"""``python -m kvmesh.bench fleet --trace PATH --workers 16 --policies all --seed 0 --out DIR``

Replays a trace on a simulated fleet under every policy (``kvmesh.fleet.evaluate``), runs the 32-concurrent
long-request and warming studies (``kvmesh.fleet.studies``), and writes ``DIR/results.json`` (the issue-6
contract), ``DIR/raw.json`` (everything measured), ``DIR/report.md`` and PNG plots. A progress bar goes to
stderr; one JSON summary line goes to stdout.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from dataclasses import asdict
from pathlib import Path
from typing import Any

from kvmesh.fleet.evaluate import evaluate
from kvmesh.fleet.metrics import Slo
from kvmesh.fleet.policies import ALL_POLICIES
from kvmesh.fleet.report import compact, write_report
from kvmesh.fleet.sim import FleetConfig
from kvmesh.fleet.studies import concurrent_long_study, warming_study


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m kvmesh.bench fleet", description=__doc__.splitlines()[0])
    p.add_argument("--trace", required=True, help="Mooncake .jsonl or Azure .csv trace")
    p.add_argument("--workers", type=int, default=16)
    p.add_argument("--policies", default="all", help=f"'all' or a comma list of {','.join(ALL_POLICIES)}")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", required=True, help="output directory")
    p.add_argument("--block-size", type=int, default=512, help="engine KV block size (divides 512)")
    p.add_argument("--kv-blocks", type=int, default=None, help="KV blocks per worker (default: perf model)")
    p.add_argument("--ttft-slo-s", type=float, default=2.0)
    p.add_argument("--itl-slo-s", type=float, default=0.1)
    p.add_argument(
        "--ttft-mode",
        choices=("excess", "absolute"),
        default="excess",
        help="absolute: TTFT itself; excess: TTFT minus the prompt's cold, idle prefill time",
    )
    p.add_argument(
        "--bisect-window-s",
        type=float,
        default=900.0,
        help="bisect capacity on the trace's first N seconds (0: whole trace)",
    )
    p.add_argument("--gpu-hour-price", type=float, default=3.5, help="USD per GPU-hour")
    p.add_argument("--jobs", type=int, default=2, help="worker processes")
    p.add_argument("--kvmesh-profile", default=None, help="YAML routing profile for 'kvmesh' (default: built-in)")
    p.add_argument(
        "--spread-arrivals",
        action="store_true",
        help="spread requests that share a timestamp evenly until the next timestamp",
    )
    p.add_argument("--skip-studies", action="store_true", help="skip the 32-concurrent and warming studies")
    p.add_argument("--study-workers", type=int, default=8, help="fleet size of the 32-concurrent study")
    return p


def _jsonable(o: Any) -> Any:
    if hasattr(o, "__dataclass_fields__"):
        return asdict(o)
    raise TypeError(f"not JSON-serialisable: {type(o).__name__}")


def main(argv: list[str] | None = None) -> int:
    a = _parser().parse_args(argv)
    pols = list(ALL_POLICIES) if a.policies == "all" else [p.strip() for p in a.policies.split(",") if p.strip()]
    unknown = set(pols) - set(ALL_POLICIES)
    if unknown:
        print(f"unknown policies: {sorted(unknown)}", file=sys.stderr)
        return 2
    if 512 % a.block_size:
        print("--block-size must divide 512", file=sys.stderr)
        return 2
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    base = FleetConfig(
        workers=a.workers,
        block_size=a.block_size,
        num_blocks=a.kv_blocks,
        seed=a.seed,
        slo=Slo(a.ttft_slo_s, a.itl_slo_s, a.ttft_mode),
        gpu_hour_price=a.gpu_hour_price,
    )
    t0 = time.perf_counter()
    trace_arg = a.trace + ("+spread" if a.spread_arrivals else "")
    ev = evaluate(
        trace_arg,
        pols,
        base,
        a.bisect_window_s or None,
        a.jobs,
        a.kvmesh_profile,
        log=lambda s: print(f"\n{s}", file=sys.stderr),
    )
    ev["trace"] = a.trace
    ev["spread_arrivals"] = a.spread_arrivals
    ev["kvmesh_profile"] = a.kvmesh_profile
    if not a.skip_studies:
        print("studies: 32 concurrent long requests, warming", file=sys.stderr)
        ev["concurrent"] = concurrent_long_study(pols, base, a.study_workers, 32, a.jobs, a.kvmesh_profile)
        ev["warming"] = warming_study(base, a.jobs, a.kvmesh_profile)
    ev["wall_s"] = time.perf_counter() - t0
    (out / "results.json").write_text(json.dumps(ev["results"], indent=2, sort_keys=True) + "\n")
    write_report(ev, out)
    (out / "raw.json").write_text(json.dumps(compact(ev), default=_jsonable) + "\n")
    r = ev["results"]
    line = {
        "bench": "fleet",
        "trace": Path(a.trace).name,
        "workers": a.workers,
        "load_scale": r["load_scale"],
        "slo_capacity": {p: r[p]["slo_capacity"] for p in pols},
        "ttft_p99_ms": {p: round(r[p]["ttft_ms"]["p99"], 1) for p in pols},
        "hit_ratio": {p: round(r[p]["hit_ratio"], 4) for p in pols},
        "pooled_lru_hit_ratio": ev["reference"]["pooled_lru_hit_ratio"],
        "wall_s": round(ev["wall_s"], 1),
    }
    print(json.dumps(line))
    return 0
