"""Markdown report and PNG plots of a fleet evaluation (matplotlib, Agg backend).

``write_report(ev, out)`` takes the dict built by ``kvmesh.bench.fleet`` (also re-loadable from
``raw.json``: ``python -m kvmesh.fleet.report DIR`` re-renders) and writes ``report.md`` plus
``ttft_cdf.png``, ``hit_ratio.png``, ``capacity.png``, ``load_over_time.png`` into ``out``.
"""

from __future__ import annotations

import json
import sys
from dataclasses import asdict, is_dataclass
from pathlib import Path
from typing import Any

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt
import numpy as np

from kvmesh.fleet.evaluate import BASELINE_FACTOR, FALLBACK_LOAD_SCALE


def _command(ev: dict[str, Any], cfg: dict[str, Any]) -> str:
    """The bench's own command line when it gave one (``ev["command"]``), else the default invocation."""
    got = ev.get("command")
    if got:
        return str(got)
    return (
        f"python -m kvmesh.bench fleet --trace {ev['trace']} --workers {cfg['workers']} --policies all "
        f"--seed {cfg['seed']} --out DIR"
    )


def _wall(ev: dict[str, Any]) -> str:
    """'wall time N min, ' when known (the bench appends the run's total at the end of a report)."""
    return f"wall time {ev['wall_s'] / 60:.0f} min, " if ev.get("wall_s") else ""


def _cfg(ev: dict[str, Any]) -> dict[str, Any]:
    c = ev["config"]
    return asdict(c) if is_dataclass(c) and not isinstance(c, type) else dict(c)


def policy_names(results: dict[str, Any]) -> list[str]:
    """The policies of a ``results.json`` (its other top-level keys describe the run: load_scale, protocol…)."""
    return [p for p, v in results.items() if isinstance(v, dict) and "slo_capacity" in v]


def targets(ev: dict[str, Any], kvmesh: dict[str, Any] | None = None) -> list[tuple[str, bool, str]]:
    """The issue's 'must show' checks for kvmesh (or for ``kvmesh``, another kvmesh result at the same
    load_scale, e.g. a tuned profile): (check, passed, evidence). None without kvmesh and a round_robin."""
    r = dict(ev["results"])
    if kvmesh is not None:
        r["kvmesh"] = kvmesh
    pols = policy_names(r)
    others = [p for p in pols if p != "kvmesh"]
    if "kvmesh" not in r or "round_robin" not in others:
        return []
    k = r["kvmesh"]
    out = []
    best_other = max(others, key=lambda p: r[p]["slo_capacity"])
    out.append(
        (
            "highest slo_capacity",
            all(k["slo_capacity"] > r[p]["slo_capacity"] for p in others),
            f"kvmesh {k['slo_capacity']:.3f} vs best other {best_other} {r[best_other]['slo_capacity']:.3f}",
        )
    )
    rr = r["round_robin"]["slo_capacity"]
    ratio = k["slo_capacity"] / rr if rr > 0 else float("inf")
    out.append(("slo_capacity ≥ 1.5× round_robin", ratio >= 1.5, f"{ratio:.2f}×"))
    lo = min(others, key=lambda p: r[p]["ttft_ms"]["p99"])
    out.append(
        (
            "lowest TTFT p99 at load_scale",
            all(k["ttft_ms"]["p99"] < r[p]["ttft_ms"]["p99"] for p in others),
            f"kvmesh {k['ttft_ms']['p99']:.0f} ms vs best other {lo} {r[lo]['ttft_ms']['p99']:.0f} ms",
        )
    )
    hg = max(others, key=lambda p: r[p]["goodput"])
    out.append(
        (
            "highest goodput at load_scale",
            all(k["goodput"] > r[p]["goodput"] for p in others),
            f"kvmesh {k['goodput']:.3f} vs best other {hg} {r[hg]['goodput']:.3f}",
        )
    )
    f = r["round_robin"]["ttft_ms"]["p99"] / max(k["ttft_ms"]["p99"], 1e-9)
    out.append(("TTFT p99 ≥ 3× lower than round_robin", f >= 3.0, f"{f:.2f}× lower"))
    if all("ttft_excess_ms" in r[p] for p in pols):
        out += _excess_targets(r, k, others)
    h = k["hit_ratio"] / max(k["pooled_lru_hit_ratio"], 1e-12)
    out.append(
        (
            "hit_ratio ≥ 95 % of pooled LRU",
            h >= 0.95,
            f"{k['hit_ratio']:.4f} / {k['pooled_lru_hit_ratio']:.4f} = {100 * h:.1f} %",
        )
    )
    return out


def _excess_targets(r: dict[str, Any], k: dict[str, Any], others: list[str]) -> list[tuple[str, bool, str]]:
    """The data-plane study's TTFT-excess checks at load_scale."""
    ex = k["ttft_excess_ms"]["p99"]
    lo = min(others, key=lambda p: r[p]["ttft_excess_ms"]["p99"])
    f = r["round_robin"]["ttft_excess_ms"]["p99"] / max(ex, 1e-9)
    return [
        (
            "lowest TTFT excess p99 at load_scale",
            all(ex < r[p]["ttft_excess_ms"]["p99"] for p in others),
            f"kvmesh {ex:.0f} ms vs best other {lo} {r[lo]['ttft_excess_ms']['p99']:.0f} ms",
        ),
        ("TTFT excess p99 ≥ 3× lower than round_robin", f >= 3.0, f"{f:.2f}× lower"),
    ]


def compact(ev: dict[str, Any], points: int = 401) -> dict[str, Any]:
    """Shrink a run's per-request latency lists to ``points`` quantiles (enough for the CDF plot) and round
    the utilisation series, so ``raw.json`` stays small. Idempotent; modifies and returns ``ev``."""
    for run in ev.get("runs", {}).values():
        t = run.pop("ttft_s", None)
        run.pop("e2e_s", None)
        if t:
            run["ttft_q"] = [round(float(x), 4) for x in np.quantile(np.asarray(t), np.linspace(0, 1, points))]
        run["util_series"] = {w: [round(float(x), 4) for x in v] for w, v in run.get("util_series", {}).items()}
    return ev


def _plots(ev: dict[str, Any], out: Path) -> None:
    r, runs = ev["results"], ev["runs"]
    pols = policy_names(r)
    fig, ax = plt.subplots(figsize=(7, 4.5))
    for p in pols:
        t = np.sort(np.asarray(runs[p].get("ttft_s") or runs[p].get("ttft_q") or [], dtype=float))
        if t.size:
            ax.plot(t, np.arange(1, t.size + 1) / t.size, label=p, lw=2.2 if p == "kvmesh" else 1.2)
    ax.set_xscale("log")
    ax.set_xlabel("TTFT (s, log)")
    ax.set_ylabel("fraction of requests")
    ax.set_title(f"TTFT CDF at load_scale {r['load_scale']:.3f}")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(out / "ttft_cdf.png", dpi=110)
    plt.close(fig)

    fig, ax = plt.subplots(figsize=(7, 4))
    ax.bar(pols, [r[p]["hit_ratio"] for p in pols], color="tab:blue")
    ax.axhline(ev["reference"]["pooled_lru_hit_ratio"], color="tab:red", ls="--", label="pooled LRU")
    ax.axhline(ev["reference"]["ideal_hit_ratio"], color="gray", ls=":", label="infinite cache")
    ax.set_ylabel("prefix hit ratio (tokens)")
    ax.legend()
    ax.tick_params(axis="x", rotation=30)
    fig.tight_layout()
    fig.savefig(out / "hit_ratio.png", dpi=110)
    plt.close(fig)

    fig, ax = plt.subplots(figsize=(7, 4))
    ax.bar(pols, [r[p]["slo_capacity"] for p in pols], color="tab:green")
    ax.axhline(
        r["load_scale"], color="k", ls="--", label=f"load_scale ({r.get('load_scale_rule', '1.25 x round_robin')})"
    )
    ax.set_ylabel("slo_capacity (arrival-rate scale)")
    ax.legend()
    ax.tick_params(axis="x", rotation=30)
    fig.tight_layout()
    fig.savefig(out / "capacity.png", dpi=110)
    plt.close(fig)

    show = [p for p in ("round_robin", "kvmesh", "dynamo", "sglang") if p in runs]
    fig, axes = plt.subplots(len(show), 1, figsize=(8, 2.3 * len(show)), sharex=True, squeeze=False)
    bucket = _cfg(ev).get("util_bucket_s", 60.0)
    mats = []
    for p in show:
        series = runs[p]["util_series"]
        width = max(1, *(len(s) for s in series.values()))  # 1: a run with no step (nothing servable)
        m = np.zeros((len(series), width))
        for i, w in enumerate(sorted(series)):
            m[i, : len(series[w])] = series[w]
        mats.append(m)
    vmax = max(0.05, *(float(np.percentile(m, 99.5)) for m in mats))
    for ax, p, m in zip(axes[:, 0], show, mats, strict=True):
        width = m.shape[1]
        im = ax.imshow(
            m,
            aspect="auto",
            vmin=0,
            vmax=vmax,
            cmap="viridis",
            interpolation="nearest",
            extent=(0, width * bucket / 60.0, len(series), 0),
        )
        ax.set_ylabel(f"{p}\nworker")
        ax.set_title(
            f"{p}: per-worker compute utilisation per {bucket:.0f} s (std across workers "
            f"{100 * float(np.std(m.mean(axis=1))):.1f} pp)",
            fontsize=8,
        )
    axes[-1, 0].set_xlabel("virtual time (min)")
    fig.colorbar(im, ax=axes[:, 0].tolist(), label="compute utilisation")
    fig.savefig(out / "load_over_time.png", dpi=80)
    plt.close(fig)


def _fmt(x: float, nd: int = 0) -> str:
    return f"{x:,.{nd}f}"


def _protocol_lines(ev: dict[str, Any]) -> list[str]:
    """The SLO protocol of ``kvmesh.fleet.evaluate`` as it was applied (same for every policy)."""
    r, ref = ev["results"], ev["reference"]
    slo = _cfg(ev)["slo"]
    prot = r.get("protocol", {})
    bis = prot.get("bisect", {"rel_tol": 0.05, "max_probes": 10})
    window = f"the first {ev['bisect_window_s']:.0f} s of the trace" if ev.get("bisect_window_s") else "the whole trace"
    gone = r.get("trace_unservable", {"count": 0})
    judged = "TTFT − cold idle prefill" if slo["ttft_mode"] == "excess" else "TTFT"
    lines = [
        f"* SLO per request: {judged} ≤ {slo['ttft_s']} s and mean ITL ≤ {1000 * slo['itl_s']:.0f} ms; a run "
        "meets it when both p99s do and no request was rejected or left unfinished.",
        f"* `slo_capacity`: highest arrival-rate scale meeting the SLO, by bisection ({100 * bis['rel_tol']:.0f} % "
        f"relative tolerance, at most {bis['max_probes']} probes) on {window}; 0 when no probe met it.",
        f"* Requests counted: every servable request of the trace, for every policy alike. "
        f"{gone['count']} request(s) no worker could ever serve were removed first "
        f"({', '.join(f'{n} {k}' for k, n in gone.get('reasons', {}).items()) or 'none'}; `trace_unservable` in "
        "results.json, and the notes below).",
        f"* `load_scale` = **{r['load_scale']:.4f}**, by the rule: {r.get('load_scale_rule', '1.25 x round_robin')} "
        f"(the rule, in order: {BASELINE_FACTOR} × round_robin's capacity if above 0; else the best baseline's "
        f"capacity if one is above 0; else {FALLBACK_LOAD_SCALE}, the trace's own rate). Metrics below are "
        "whole-trace runs at that scale.",
        f"* Reference hit ratios: pooled LRU (one LRU with the fleet's {ref['fleet_kv_blocks']:,} blocks) "
        f"**{ref['pooled_lru_hit_ratio']:.4f}**, infinite cache {ref['ideal_hit_ratio']:.4f}.",
        "* The protocol in full: `docs/fleet-report/protocol.md` and `kvmesh/fleet/evaluate.py`.",
    ]
    return lines


def render(ev: dict[str, Any]) -> str:
    r, runs, caps, ref = ev["results"], ev["runs"], ev["capacities"], ev["reference"]
    cfg = _cfg(ev)
    slo = cfg["slo"]
    pols = policy_names(r)
    L: list[str] = []
    L += ["# Fleet evaluation: routing policies on a simulated H200 fleet", ""]
    L += [
        f"Trace `{Path(ev['trace']).name}`, {cfg['workers']} simulated workers (H200 + 70B FP8 perf model, "
        f"KV block {cfg['block_size']} tokens, {ref['fleet_kv_blocks']:,} KV blocks in the fleet), seed "
        f"{cfg['seed']}. kvmesh profile: {ev.get('kvmesh_profile') or 'built-in default'}. "
        f"Reproduce: `{_command(ev, cfg)}` ({_wall(ev)}{ev.get('cpu_count')} CPUs).",
        "",
    ]
    L += ["## SLO and protocol", "", *_protocol_lines(ev), ""]
    if slo["ttft_mode"] == "excess":
        L += [
            "The fleet evaluation's literal SLO (absolute TTFT p99 ≤ 2 s) cannot be met on the development trace at "
            "any load: with the perf model, the prefill of more than 1 % of its prompts alone takes over 2 s on an "
            "idle H200 even with an infinite cache (see the notes at the end), so every policy's capacity would "
            "be 0. The SLO's TTFT condition is therefore applied to TTFT minus the prompt's own prefill time on "
            "a cold, idle engine (cache hits make it negative, queueing positive). Reported TTFT percentiles are "
            "absolute; *TTFT excess* is TTFT minus the request's own TTFT on an idle engine with an infinite "
            "cache (`kvmesh.fleet.ideal`), never negative: the queueing and the lost cache a policy caused.",
            "",
        ]
    L += [
        "## Results at load_scale",
        "",
        "| policy | slo_capacity | TTFT p50 | TTFT p90 | TTFT p99 | TTFT excess p50 | TTFT excess p90 "
        "| TTFT excess p99 | e2e p50 | e2e p99 | ITL p99 | hit ratio "
        "| hit / pooled LRU | out tok/s | goodput | util var | util cv | $/Mtok |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for p in pols:
        x, s = r[p], runs[p]["summary"]
        ex = x.get("ttft_excess_ms", {})
        L.append(
            f"| {p} | {x['slo_capacity']:.3f} | {_fmt(x['ttft_ms']['p50'])} | {_fmt(x['ttft_ms']['p90'])} | "
            f"{_fmt(x['ttft_ms']['p99'])} | "
            + " | ".join(_fmt(ex.get(q, float("nan"))) for q in ("p50", "p90", "p99"))
            + f" | {_fmt(x['e2e_ms']['p50'])} | {_fmt(x['e2e_ms']['p99'])} | "
            f"{_fmt(s.get('itl_ms', {}).get('p99', float('nan')))} | {x['hit_ratio']:.4f} | "
            f"{100 * x['hit_ratio'] / max(x['pooled_lru_hit_ratio'], 1e-12):.0f} % | "
            f"{_fmt(x['output_tokens_per_s'])} | {x['goodput']:.3f} | {x['util_variance']:.5f} | "
            f"{s.get('util_cv', float('nan')):.3f} | {s.get('cost_per_mtok', float('nan')):.3f} |"
        )
    L += [
        "",
        "Latencies in ms. util = per-worker compute utilisation (see `kvmesh/fleet/metrics.py`); "
        f"cost at ${cfg['gpu_hour_price']}/GPU-hour over prompt + output tokens.",
        "",
    ]
    L += [
        "![TTFT CDF](ttft_cdf.png)",
        "",
        "![hit ratio](hit_ratio.png)",
        "",
        "![capacity](capacity.png)",
        "",
        "![per-worker load over time](load_over_time.png)",
        "",
    ]
    checks = targets(ev)
    if checks:
        L += ["## Targets of issues 6 and 14 (kvmesh default)", "", "| target | met | evidence |", "|---|---|---|"]
    for name, ok, evd in checks:
        L.append(f"| {name} | {'yes' if ok else '**no**'} | {evd} |")
    tuned = ev.get("kvmesh_tuned")
    if tuned:
        t = tuned["results"]
        L += [
            "",
            f"## kvmesh with a tuned profile (`{tuned['profile']}`)",
            "",
            tuned.get("description", ""),
            "",
            "| policy | slo_capacity | TTFT p50 | TTFT p90 | TTFT p99 | e2e p50 | e2e p99 | hit ratio "
            "| hit / pooled LRU | goodput | util var |",
            "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
        ]
        for name, x in (("kvmesh (default)", r["kvmesh"]), ("kvmesh (tuned)", t)):
            L.append(
                f"| {name} | {x['slo_capacity']:.3f} | {_fmt(x['ttft_ms']['p50'])} | "
                f"{_fmt(x['ttft_ms']['p90'])} | {_fmt(x['ttft_ms']['p99'])} | {_fmt(x['e2e_ms']['p50'])} | "
                f"{_fmt(x['e2e_ms']['p99'])} | {x['hit_ratio']:.4f} | "
                f"{100 * x['hit_ratio'] / max(x['pooled_lru_hit_ratio'], 1e-12):.0f} % | {x['goodput']:.3f} | "
                f"{x['util_variance']:.5f} |"
            )
        L += ["", "| target (tuned kvmesh) | met | evidence |", "|---|---|---|"]
        for name, ok, evd in targets(ev, t):
            L.append(f"| {name} | {'yes' if ok else '**no**'} | {evd} |")
    L += [
        "",
        "## Capacity probes",
        "",
        "Each policy's SLO curve: the load scales the bisection tried, ✓ where the run met the SLO. A policy "
        "with no ✓ never met it (capacity 0, even at the smallest scale tried).",
        "",
        "| policy | probes (scale: pass/fail) |",
        "|---|---|",
    ]
    for p in pols:
        pr = ", ".join(f"{q['scale']:.3f}:{'✓' if q['meets'] else '✗'}" for q in caps[p]["probes"])
        L.append(f"| {p} | {pr} |")
    if "concurrent" in ev:
        c = ev["concurrent"]
        L += [
            "",
            f"## 32 concurrent long requests ({c['clients']} closed-loop clients, {c['workers']} workers)",
            "",
            "Each client sends 6 questions (128–1024 tokens) over one of 16 shared documents "
            "(16K–96K tokens), back to back (`synthetic.concurrent_long`).",
            "",
            "| policy | e2e p50 | e2e p99 | TTFT p99 | hit ratio | util mean | util std (pp) | util var |",
            "|---|---:|---:|---:|---:|---:|---:|---:|",
        ]
        for p, o in c["runs"].items():
            s = o["summary"]
            L.append(
                f"| {p} | {_fmt(s['e2e_ms']['p50'])} | {_fmt(s['e2e_ms']['p99'])} | "
                f"{_fmt(s['ttft_ms']['p99'])} | {s['hit_ratio']:.3f} | {s['util_mean']:.3f} | "
                f"{100 * s['util_variance'] ** 0.5:.1f} | {s['util_variance']:.5f} |"
            )
    if "warming" in ev:
        w = ev["warming"]
        L += [
            "",
            "## Warming: none / static / dynamic (kvmesh policy)",
            "",
            f"Workload: `synthetic.shared_prefix_tenants` {w['workload']}. static = system prompts of the "
            "top 30 % tenants on 2 workers each at t=0; dynamic = prefixes seen ≥ 5×/min warmed onto "
            "more workers (`kvmesh.ops.warming`).",
            "",
            "| warming | TTFT p50 | TTFT p90 | TTFT p99 | hit ratio | warm requests |",
            "|---|---:|---:|---:|---:|---:|",
        ]
        for m, o in w["runs"].items():
            s = o["summary"]
            L.append(
                f"| {m} | {_fmt(s['ttft_ms']['p50'])} | {_fmt(s['ttft_ms']['p90'])} | "
                f"{_fmt(s['ttft_ms']['p99'])} | {s['hit_ratio']:.4f} | {s['warm_requests']} |"
            )
    if ev.get("analysis_md"):
        L += ["", "## Analysis", "", str(ev["analysis_md"]).strip()]
    walls = {p: runs[p].get("wall_s", 0.0) for p in pols}
    speed = [
        f"Simulator speed: each whole-trace run at load_scale took {min(walls.values()):.0f}–"
        f"{max(walls.values()):.0f} s of wall time on this machine ({len(ev['runs'])} runs, "
        f"{min(runs[p].get('events', 0) for p in pols):,}–{max(runs[p].get('events', 0) for p in pols):,} "
        "events each, shared CPUs)."
    ]
    L += ["", "## Notes", ""] + [f"* {n}" for n in [*ev.get("notes", []), *speed]]
    return "\n".join(L) + "\n"


def write_report(ev: dict[str, Any], out: Path) -> None:
    out.mkdir(parents=True, exist_ok=True)
    _plots(ev, out)
    (out / "report.md").write_text(render(ev))


if __name__ == "__main__":
    d = Path(sys.argv[1])
    write_report(json.loads((d / "raw.json").read_text()), d)
