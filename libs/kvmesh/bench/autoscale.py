"""``python -m kvmesh.bench autoscale --trace PATH [--seed 0] --out DIR``: an autoscaled simulated fleet
against a fixed one sized for the peak, over one day built from the trace's hour, the planner's forecaster
chosen on a held-out day first (protocol: :mod:`kvmesh.fleet.autoscale_eval`).

Prints one JSON line ``{"fixed": {gpu_hours, slo_met, ttft_p99_ms, cost_usd, ...}, "autoscaled": {..., min_workers,
max_workers}, "forecast": {lstm_mae, baselines, chosen}, ...}`` and writes ``results.json`` (with the day's
series), ``workers.png`` and ``report.md`` to DIR.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path
from typing import Any

from kvmesh.fleet.autoscale_eval import AutoscaleStudy, evaluate
from kvmesh.fleet.diurnal import DayShape
from kvmesh.fleet.readers import read_trace


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m kvmesh.bench autoscale", description=__doc__.splitlines()[0])
    p.add_argument("--trace", required=True, help="Mooncake .jsonl or Azure .csv trace (its first hour is used)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", required=True, help="output directory")
    p.add_argument("--peak-workers", type=int, default=16, help="about this many workers serve the peak hour")
    p.add_argument("--measure-workers", type=int, default=16, help="fleet size of the capacity measurement")
    p.add_argument("--history-days", type=int, default=3, help="days the forecaster trains on")
    p.add_argument("--trough", type=float, default=0.25, help="lowest hour's rate / the peak hour's")
    p.add_argument("--startup-s", type=float, default=300.0, help="a started worker's time to serve")
    p.add_argument("--gpu-hour-price", type=float, default=3.5, help="USD per GPU-hour")
    p.add_argument("--lstm-epochs", type=int, default=150)
    p.add_argument(
        "--slo-windows",
        type=int,
        default=0,
        help="0: simulate the whole day; N: GPU-hours from the planner replayed on arrivals, SLO on N hardest hours",
    )
    p.add_argument(
        "--per-worker-rps",
        type=float,
        default=None,
        help="capacity model given (requests/s per worker within the SLO) instead of measured",
    )
    return p


def _plot(res: dict[str, Any], out: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    arrivals = res["series"]["arrivals_5min"]
    tl = res["series"]["timeline"]
    fig, ax = plt.subplots(figsize=(8, 4))
    ax.plot([i * 300 / 3600 for i in range(len(arrivals))], [a / 300 for a in arrivals], color="grey", lw=0.8)
    ax.set_xlabel("hour of the simulated day")
    ax.set_ylabel("arrivals per second", color="grey")
    ax2 = ax.twinx()
    ax2.step([t[0] / 3600 for t in tl], [t[1] for t in tl], where="post", label="serving")
    ax2.step([t[0] / 3600 for t in tl], [t[3] for t in tl], where="post", label="desired", ls="--")
    ax2.axhline(res["fixed"]["workers"], color="red", lw=0.8, label="fixed fleet")
    ax2.set_ylabel("workers")
    ax2.legend(loc="upper left")
    fig.tight_layout()
    fig.savefig(out / "workers.png", dpi=100)
    plt.close(fig)


def _report(res: dict[str, Any], argv: list[str], wall_s: float) -> str:
    f, a, fc = res["fixed"], res["autoscaled"], res["forecast"]
    sizes = (str(f["workers"]), f"{a['min_workers']}–{a['max_workers']}")
    rows = [
        f"| {name} | {size} | {x['gpu_hours']} | {x['cost_usd']} | {x['slo_met']} | {x['ttft_p99_ms']} | "
        f"{x['goodput']} |"
        for name, size, x in (("fixed (peak)", sizes[0], f), ("autoscaled", sizes[1], a))
    ]
    base = ", ".join(f"{k} {v}" for k, v in fc["baselines"].items())
    return "\n".join(
        [
            f"# Autoscaling: `{res['trace']}`",
            "",
            f"`python -m kvmesh.bench autoscale {' '.join(argv)}` ({wall_s / 60:.1f} min). Protocol: "
            "`kvmesh.fleet.autoscale_eval` (module docstring).",
            "",
            "| fleet | workers | GPU-hours | cost USD | SLO met | TTFT p99 ms | goodput |",
            "|---|---|---:|---:|---|---:|---:|",
            *rows,
            "",
            f"GPU-hours saved: **{100 * res['gpu_hours_saved']:.1f} %**. Forecast MAE on the held-out day "
            f"(arrivals per 5 min, next hour): LSTM {fc['lstm_mae']}; {base}; the planner used **{fc['chosen']}**.",
            f"Capacity model: {res['capacity_model']}.",
            *_windows_lines(res),
            "",
            "![workers over the day](workers.png)",
            "",
        ]
    )


def _windows_lines(res: dict[str, Any]) -> list[str]:
    if "slo_windows" not in res:
        return [f"Open-loop replay of the planner (no simulated fleet): {res['autoscaled']['open_loop_gpu_hours']} "
                "GPU-hours autoscaled."]  # fmt: skip
    rows = [
        f"| {w['hour']} | {w['fixed']['slo_met']} / {w['autoscaled']['slo_met']} | "
        f"{w['fixed']['ttft_p99_ms']} / {w['autoscaled']['ttft_p99_ms']} | "
        f"{w['fixed']['goodput']} / {w['autoscaled']['goodput']} | {w['autoscaled']['requests']} |"
        for w in res["slo_windows"]
    ]
    return [
        "",
        "SLO judged on these hours, each simulated in full for both fleets (fixed / autoscaled); the autoscaled "
        "GPU-hours are the planner's open-loop replay over the whole day (`kvmesh.fleet.autoscale_eval`, step 5).",
        "",
        "| hour | SLO met | TTFT p99 ms | goodput | requests |",
        "|---:|---|---|---|---:|",
        *rows,
    ]


def main(argv: list[str] | None = None) -> int:
    args_list = list(argv or [])
    parser = _parser()
    a = parser.parse_args(args_list)
    if not 0 <= a.slo_windows <= 24:
        parser.error(f"--slo-windows must be in [0, 24], got {a.slo_windows}")
    if a.per_worker_rps is not None and not a.per_worker_rps > 0:
        parser.error(f"--per-worker-rps must be > 0, got {a.per_worker_rps}")
    study = AutoscaleStudy(
        peak_workers=a.peak_workers,
        measure_workers=a.measure_workers,
        history_days=a.history_days,
        shape=DayShape(trough=a.trough),
        seed=a.seed,
        gpu_hour_price=a.gpu_hour_price,
        startup_s=a.startup_s,
        lstm_epochs=a.lstm_epochs,
        slo_windows=a.slo_windows,
        per_worker_rps=a.per_worker_rps,
    )
    started = time.perf_counter()
    res = evaluate(read_trace(a.trace), study)
    wall = time.perf_counter() - started
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "results.json").write_text(json.dumps(res, indent=1))
    _plot(res, out)
    (out / "report.md").write_text(_report(res, args_list, wall))
    print(json.dumps({k: v for k, v in res.items() if k != "series"} | {"wall_s": round(wall, 1)}))
    return 0
