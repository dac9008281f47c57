"""``python -m kvmesh.bench fleet --trace PATH --workers 16 --policies all --seed 0 --out DIR``

Replays a trace on a simulated fleet under every policy (``kvmesh.fleet.evaluate``), runs the 32-concurrent
long-request and warming studies (``kvmesh.fleet.studies``), and writes ``DIR/results.json`` (the issue-6
contract), ``DIR/raw.json`` (everything measured), ``DIR/report.md`` and PNG plots. A progress bar goes to
stderr; one JSON summary line goes to stdout.

``--data-plane --cpu-tier-gb G [--disk-tier-gb D]`` gives every simulated worker a CPU tier of G GB (and a
disk tier of D GB) that keeps what its GPU pool evicts; kvmesh also pulls prefixes from peers
(``kvmesh.fleet.tiers``, ``kvmesh.routing.dataplane``). ``results.json`` then also holds, at the top level,
``pooled_lru_same_capacity_hit_ratio`` (one LRU over the fleet's GPU + tier capacity), ``data_plane`` (the
tiers, links and margin used), ``kvmesh_data_plane_off`` (kvmesh's capacity and hit ratio without the data
plane, same protocol, same invocation; ``--no-off-baseline`` skips it) and, with ``--tier-sweep-gb``,
``tier_sweep`` (kvmesh's hit ratio at load_scale against the CPU tier size); per policy ``data_plane`` holds
the run's transfer counts. Without ``--data-plane`` the run is the one without tiers.

``--pd [--link-gbps 100] [--pd-policies LIST] [--splits 4,8,12]`` adds prefill/decode disaggregation
(``kvmesh.fleet.pd``, ``kvmesh.fleet.pd_eval``) at the same total GPUs: for every P/D policy (kvmesh and each
peer's decider) the best xPyD split by SLO capacity on the bisection window, written beside the aggregated
figures in that policy's entry as ``"pd": {"slo_capacity", "split", "disagg_share", "handoff_ms": {"p50",
"p99"}, "fallbacks", ...}`` (a P/D policy with no aggregated entry, ``vllm_router`` or ``always``, gets an
entry with its routing policy and ``pd``), and kvmesh's aggregated capacity at its best per-step token budget
(``best_chunk``, ``pd_eval.CHUNK_CANDIDATES``; ``--no-chunk-search`` skips it) with the gain
``pd_over_best_chunk``.
"""

from __future__ import annotations

import argparse
import json
import shlex
import sys
import time
from dataclasses import asdict, replace
from pathlib import Path
from typing import Any

from kvmesh.fleet.evaluate import Job, evaluate, load_trace, run_jobs
from kvmesh.fleet.metrics import Slo
from kvmesh.fleet.pd import PD_DECIDERS, PD_ROUTING
from kvmesh.fleet.pd_eval import CHUNK_CANDIDATES, chunk_configs, default_splits, pd_entry, split_configs
from kvmesh.fleet.policies import ALL_POLICIES
from kvmesh.fleet.reference import pooled_lru_hit_ratio
from kvmesh.fleet.report import compact, write_report
from kvmesh.fleet.sim import FleetConfig, HashCache
from kvmesh.fleet.studies import concurrent_long_study, warming_study
from kvmesh.fleet.tiers import DataPlane


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
    p.add_argument("--data-plane", action="store_true", help="CPU/disk tiers on every worker, peer pulls for kvmesh")
    p.add_argument("--cpu-tier-gb", type=float, default=256.0, help="CPU tier per worker (GPU), GB")
    p.add_argument("--disk-tier-gb", type=float, default=0.0, help="disk tier per worker, GB (0: none)")
    p.add_argument("--pull-margin", type=float, default=2.0, help="pull only if margin x pull time < recompute")
    p.add_argument(
        "--tier-sweep-gb", default="", help="comma list of CPU tier sizes: kvmesh's hit ratio at load_scale for each"
    )
    p.add_argument("--no-off-baseline", action="store_true", help="with --data-plane: skip kvmesh without it")
    p.add_argument("--pd", action="store_true", help="also prefill/decode pools: best split per P/D policy")
    p.add_argument("--link-gbps", type=float, default=100.0, help="with --pd: each worker's NIC for the handoff")
    p.add_argument("--pd-policies", default=",".join(PD_DECIDERS), help=f"comma list of {','.join(PD_DECIDERS)}")
    p.add_argument("--splits", default="", help="comma list of prefill worker counts (default: quarter to 7/8)")
    p.add_argument("--no-chunk-search", action="store_true", help="with --pd: skip kvmesh's best-budget search")
    return p


def pd_extras(
    trace_arg: str,
    base: FleetConfig,
    ev: dict[str, Any],
    a: argparse.Namespace,
    pd_pols: list[str],
) -> None:
    """The --pd searches (module docstring), written into ``ev["results"]``: first kvmesh's best step budget
    (the aggregated fleet's, and the decode engines' of every P/D fleet), then the best split per policy."""
    splits = [int(x) for x in a.splits.split(",") if x.strip()] or default_splits(base.workers)
    labels = tuple(f"{x}P{base.workers - x}D" for x in splits)
    window = ev["bisect_window_s"]
    res = ev["results"]
    pd_base = base
    if not a.no_chunk_search:
        print(f"pd: kvmesh's best step budget of {len(CHUNK_CANDIDATES)}", file=sys.stderr)
        chunk_labels = tuple(f"{b}/{c}" for b, c in CHUNK_CANDIDATES)
        job = Job("search", "kvmesh", base, window, a.kvmesh_profile, False, tuple(chunk_configs(base)), chunk_labels)
        found = run_jobs(trace_arg, base, [job], 1)[0]
        b, c = CHUNK_CANDIDATES[found["best"]] if found["best"] is not None else CHUNK_CANDIDATES[0]
        pd_base = chunk_configs(base, [(b, c)])[0]
        res["kvmesh"]["best_chunk"] = {
            "slo_capacity": found["slo_capacity"],
            "max_batched_tokens": b,
            "prefill_chunk_tokens": c,
            "searched": found["searched"],
        }
    todo = []
    for d in pd_pols:
        xs = [x for x in splits if x > 0] if d == "always" else splits  # always-disaggregate needs a prefill pool
        cands = tuple(split_configs(pd_base, d, xs, a.link_gbps))
        lbs = tuple(f"{x}P{base.workers - x}D" for x in xs)
        todo.append(Job("search", PD_ROUTING[d], pd_base, window, a.kvmesh_profile, False, cands, lbs))
    print(f"pd: {len(todo)} split searches ({', '.join(labels)})", file=sys.stderr)
    for d, found in zip(pd_pols, run_jobs(trace_arg, base, todo, a.jobs), strict=True):
        entry = res.setdefault(d, {"routing": PD_ROUTING[d]})
        entry["pd"] = pd_entry(found)
        entry["pd"]["decode_engine"] = {
            "max_batched_tokens": pd_base.max_batched_tokens,
            "prefill_chunk_tokens": pd_base.prefill_chunk_tokens,
        }
    best = res["kvmesh"].get("best_chunk")
    if best and "kvmesh" in pd_pols and best["slo_capacity"] > 0:
        res["kvmesh"]["pd_over_best_chunk"] = res["kvmesh"]["pd"]["slo_capacity"] / best["slo_capacity"]


def pd_section(results: dict[str, Any], pd_pols: list[str]) -> str:
    """Markdown appended to report.md for a --pd run."""
    lines = [
        "",
        "## Prefill/decode disaggregation",
        "",
        "Same total GPUs; per P/D policy the best xPyD split by slo_capacity on the bisection window "
        "(`kvmesh.fleet.pd`, `kvmesh.fleet.pd_eval`). *aggregated*: the policy's slo_capacity above (engine "
        "default: step budget 8192, chunk 1024).",
        "",
        "| P/D policy | routing | aggregated | P/D slo_capacity | split | disaggregated | handoff p50 / p99 ms "
        "| fallbacks | ITL p99 ms |",
        "|---|---|---:|---:|---|---:|---:|---:|---:|",
    ]
    for d in pd_pols:
        r = results.get(d, {})
        pd = r.get("pd")
        if not pd:
            continue
        agg = results.get(PD_ROUTING[d], {}).get("slo_capacity")
        ho = pd["handoff_ms"]
        share = pd["disagg_share"]
        lines.append(
            f"| {d} | {PD_ROUTING[d]} | {agg if agg is None else f'{agg:.3f}'} | {pd['slo_capacity']:.3f} "
            f"| {pd['split'] or ''} | {'' if share is None else f'{100 * share:.0f} %'} "
            f"| {_ms(ho.get('p50'))} / {_ms(ho.get('p99'))} | {pd['fallbacks'] or 0} | {_ms(pd.get('itl_p99_ms'))} |"
        )
    best = results.get("kvmesh", {}).get("best_chunk")
    if best:
        lines += [
            "",
            f"kvmesh aggregated at its best step budget ({best['max_batched_tokens']} tokens, chunk "
            f"{best['prefill_chunk_tokens']}): slo_capacity **{best['slo_capacity']:.3f}** (searched: "
            + ", ".join(f"{c['label']} {_cap(c['capacity'])}" for c in best["searched"])
            + ").",
        ]
        gain = results["kvmesh"].get("pd_over_best_chunk")
        if gain is not None:
            lines.append(f"kvmesh P/D over kvmesh aggregated at its best budget: **{gain:.2f}×**.")
    return "\n".join(lines) + "\n"


def _cap(v: float | None) -> str:
    return "below the best (one probe)" if v is None else f"{v:.3f}"


def _ms(v: float | None) -> str:
    return "" if v is None else f"{v:,.0f}"


def same_capacity_ratio(trace_arg: str, cfg: FleetConfig) -> float:
    """Pooled-LRU hit ratio of one LRU holding the fleet's whole GPU + tier capacity."""
    tr = load_trace(trace_arg)
    hc = HashCache(tr, cfg.block_size)
    prompts = [(r.input_len, hc.hashes(r.index)) for r in tr]
    return pooled_lru_hit_ratio(prompts, cfg.block_size, cfg.fleet_capacity_blocks())


def data_plane_extras(
    trace_arg: str, base: FleetConfig, ev: dict[str, Any], jobs: int, profile: str | None, sweep: list[float], off: bool
) -> dict[str, Any]:
    """The top-level results.json keys of a --data-plane run (module docstring)."""
    dp = base.data_plane
    assert dp is not None
    spec = dp.spec(base.block_size)
    extra: dict[str, Any] = {
        "pooled_lru_same_capacity_hit_ratio": same_capacity_ratio(trace_arg, base),
        "data_plane": {
            **asdict(dp),
            "cpu_tier_blocks_per_worker": spec.cpu_blocks,
            "disk_tier_blocks_per_worker": spec.disk_blocks,
            "gpu_blocks_per_worker": base.gpu_blocks_per_worker(),
            "fleet_capacity_blocks": base.fleet_capacity_blocks(),
            "transfer_costs": asdict(dp.transfer_costs(base.block_size)),
        },
    }
    at = replace(base, load_scale=ev["results"]["load_scale"])
    todo: list[Job] = []
    if off:
        window = ev["bisect_window_s"]
        todo += [
            Job("capacity", "kvmesh", replace(base, data_plane=None), window, profile, False),
            Job("run", "kvmesh", replace(at, data_plane=None), None, profile, False),
        ]
    todo += [
        Job("run", "kvmesh", replace(at, data_plane=replace(dp, cpu_tier_gb=g)), None, profile, False) for g in sweep
    ]
    if not todo:
        return extra
    print(f"data plane: {len(todo)} more jobs (kvmesh without it, tier sweep)", file=sys.stderr)
    done = run_jobs(trace_arg, base, todo, jobs)
    if off:
        cap, run = done[0], done[1]["summary"]
        extra["kvmesh_data_plane_off"] = {
            "slo_capacity": cap["slo_capacity"],
            "hit_ratio": run["hit_ratio"],
            "ttft_ms": {k: run["ttft_ms"][k] for k in ("p50", "p90", "p99")},
            "goodput": run["goodput"],
        }
        done = done[2:]
    if sweep:
        extra["tier_sweep"] = [
            {
                "cpu_tier_gb": g,
                "hit_ratio": d["summary"]["hit_ratio"],
                "pooled_lru_same_capacity_hit_ratio": (
                    pl := same_capacity_ratio(trace_arg, replace(base, data_plane=replace(dp, cpu_tier_gb=g)))
                ),
                "of_pooled_lru": d["summary"]["hit_ratio"] / max(pl, 1e-12),
            }
            for g, d in zip(sweep, done, strict=True)
        ]
    return extra


def data_plane_section(results: dict[str, Any], pols: list[str]) -> str:
    """Markdown appended to report.md for a --data-plane run."""
    dp = results["data_plane"]
    pooled = results["pooled_lru_same_capacity_hit_ratio"]
    disk = f", disk tier {dp['disk_tier_gb']:g} GB" if dp["disk_tier_gb"] else ""
    lines = [
        "",
        "## Data plane",
        "",
        f"Every worker has a CPU tier of {dp['cpu_tier_gb']:g} GB ({dp['cpu_tier_blocks_per_worker']} blocks"
        f"{disk}) next to its "
        f"{dp['gpu_blocks_per_worker']} GPU blocks; kvmesh also pulls from peers (margin {dp['pull_margin']:g}). "
        f"Links: {dp['links']['host_to_gpu_bytes_per_s'] / 1e9:g} GB/s host→GPU, "
        f"{dp['links']['network_bytes_per_s'] / 1e9:.2f} GB/s network per GPU, RTT "
        f"{dp['links']['network_rtt_s'] * 1e3:g} ms (docs/engine-model.md). Pooled LRU of the same total capacity "
        f"({dp['fleet_capacity_blocks']} blocks): **{pooled:.4f}**.",
        "",
        "| policy | slo_capacity | hit ratio | of same-capacity pooled LRU | tier loads | pulled blocks |",
        "|---|---:|---:|---:|---:|---:|",
    ]
    for p in pols:
        r = results[p]
        d = r.get("data_plane", {})
        loads = d.get("loaded_cpu_blocks", 0) + d.get("loaded_disk_blocks", 0)
        lines.append(
            f"| {p} | {r['slo_capacity']:.3f} | {r['hit_ratio']:.4f} | {r['hit_ratio'] / max(pooled, 1e-12):.0%} "
            f"| {loads:,.0f} | {d.get('pulled_blocks', 0):,.0f} |"
        )
    off = results.get("kvmesh_data_plane_off")
    if off:
        lines.append(f"| kvmesh, data plane off | {off['slo_capacity']:.3f} | {off['hit_ratio']:.4f} | | | |")
    sweep = results.get("tier_sweep")
    if sweep:
        lines += ["", "| CPU tier GB | kvmesh hit ratio | pooled LRU, same capacity | ratio |", "|---:|---:|---:|---:|"]
        lines += [
            f"| {t['cpu_tier_gb']:g} | {t['hit_ratio']:.4f} | {t['pooled_lru_same_capacity_hit_ratio']:.4f} "
            f"| {100 * t['of_pooled_lru']:.0f} % |"
            for t in sweep
        ]
    return "\n".join(lines) + "\n"


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
    pd_pols = [p.strip() for p in a.pd_policies.split(",") if p.strip()] if a.pd else []
    if set(pd_pols) - set(PD_DECIDERS):
        print(f"unknown --pd-policies: {sorted(set(pd_pols) - set(PD_DECIDERS))}", file=sys.stderr)
        return 2
    if a.pd and a.link_gbps <= 0:
        print("--link-gbps must be > 0", file=sys.stderr)
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
        data_plane=DataPlane(a.cpu_tier_gb, a.disk_tier_gb, pull_margin=a.pull_margin) if a.data_plane else None,
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
    ev["command"] = "python -m kvmesh.bench fleet " + shlex.join(sys.argv[1:] if argv is None else argv)
    ev["spread_arrivals"] = a.spread_arrivals
    ev["kvmesh_profile"] = a.kvmesh_profile
    if not a.skip_studies:
        print("studies: 32 concurrent long requests, warming", file=sys.stderr)
        ev["concurrent"] = concurrent_long_study(pols, base, a.study_workers, 32, a.jobs, a.kvmesh_profile)
        ev["warming"] = warming_study(base, a.jobs, a.kvmesh_profile)
    write_report(ev, out)
    if base.data_plane is not None:
        sweep = [float(g) for g in a.tier_sweep_gb.split(",") if g.strip()]
        for p in pols:
            ev["results"][p]["data_plane"] = ev["runs"][p]["summary"].get("data_plane", {})
        extra = data_plane_extras(trace_arg, base, ev, a.jobs, a.kvmesh_profile, sweep, not a.no_off_baseline)
        ev["results"].update(extra)  # after write_report: its tables iterate the policies of results
        with (out / "report.md").open("a") as f:
            f.write(data_plane_section(ev["results"], pols))
    if pd_pols:
        pd_extras(trace_arg, base, ev, a, pd_pols)
        with (out / "report.md").open("a") as f:
            f.write(pd_section(ev["results"], pd_pols))
    ev["wall_s"] = time.perf_counter() - t0
    with (out / "report.md").open("a") as f:
        f.write(f"\nWall time of the whole run: {ev['wall_s'] / 60:.1f} min on {ev['cpu_count']} CPUs.\n")
    (out / "results.json").write_text(json.dumps(ev["results"], indent=2, sort_keys=True) + "\n")
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
        **({k: r[k] for k in ("pooled_lru_same_capacity_hit_ratio",) if k in r}),
        **({"pd_slo_capacity": {d: r[d]["pd"]["slo_capacity"] for d in pd_pols}} if pd_pols else {}),
        **(
            {"kvmesh_best_chunk_slo_capacity": r["kvmesh"]["best_chunk"]["slo_capacity"]}
            if "best_chunk" in r.get("kvmesh", {})
            else {}
        ),
        "wall_s": round(ev["wall_s"], 1),
    }
    print(json.dumps(line))
    return 0
