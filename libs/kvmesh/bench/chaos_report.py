"""The chaos campaign's output: the JSON line, the soak figures, and with ``--out DIR`` the history (JSONL:
the schedule, every fault as carried out, every request with its events, every soak sample) and a plot of
load, faults and latency over time."""

from __future__ import annotations

import json
import statistics
from collections.abc import Sequence
from dataclasses import asdict
from pathlib import Path
from typing import Any

from kvmesh.bench.chaos_check import RequestRecord, Tally, verdict
from kvmesh.bench.chaos_runner import FaultLog, Sample

MIN_SPAN_S = 60.0  # a process instance sampled for less (after warm-up) gives no growth figure


def growth_per_hour(samples: Sequence[Sample], warmup_s: float) -> dict[str, dict[str, float | None]]:
    """Per target, the least-squares slope per hour of RSS (MiB), fds and threads over one process instance
    (a restart starts afresh): the instance sampled longest once its own first `warmup_s` are left out (a
    process restarted mid-run warms up again: its pools and caches fill), the latest of equals. ``rss_pct``
    is the RSS slope as a share of that instance's mean RSS (percent per hour). None where no instance was
    sampled for `MIN_SPAN_S` after its warm-up. ``tasks``: the slope of its asyncio tasks as its /metrics
    says (`kvmesh_asyncio_tasks`), None where unread (Redis)."""
    out: dict[str, dict[str, float | None]] = {}
    for target in sorted({s.target for s in samples}):
        instances: dict[int, list[Sample]] = {}
        for s in samples:
            if s.target == target:
                instances.setdefault(s.pid, []).append(s)
        warm = [[p for p in pts if p.t >= pts[0].t + warmup_s] for pts in instances.values()]
        pts = max(warm, key=lambda w: (w[-1].t - w[0].t if len(w) >= 2 else -1.0, w[-1].t if w else -1.0))
        fig: dict[str, float | None] = {"rss_mb": None, "rss_pct": None, "fds": None, "threads": None, "tasks": None}
        if len(pts) >= 3 and pts[-1].t - pts[0].t >= MIN_SPAN_S:
            ts = [p.t for p in pts]
            for name in ("rss_mb", "fds", "threads"):
                ys = [float(getattr(p, name)) for p in pts]
                slope = statistics.linear_regression(ts, ys).slope if len(set(ys)) > 1 else 0.0
                fig[name] = round(slope * 3600, 2)
            read = [p for p in pts if p.tasks is not None]
            if len(read) >= 3 and read[-1].t - read[0].t >= MIN_SPAN_S:
                ys = [float(p.tasks or 0) for p in read]
                slope = statistics.linear_regression([p.t for p in read], ys).slope if len(set(ys)) > 1 else 0.0
                fig["tasks"] = round(slope * 3600, 2)
            mean_rss = statistics.fmean(p.rss_mb for p in pts)
            fig["rss_pct"] = round(100 * (fig["rss_mb"] or 0.0) / mean_rss, 2) if mean_rss else None
        out[target] = fig
    return out


def result_line(
    seed: int,
    duration_s: float,
    fault_counts: dict[str, int],
    tally: Tally,
    final: dict[str, Any],
    leftover_shm: list[str],
    growth: dict[str, dict[str, float | None]],
    extra: dict[str, Any],
) -> dict[str, Any]:
    return {
        "bench": "chaos",
        "seed": seed,
        "duration_s": duration_s,
        "faults": fault_counts,
        "requests": tally.requests,
        "succeeded": tally.succeeded,
        "retried_ok": tally.retried_ok,
        "migrated_ok": tally.migrated_ok,
        "lost": tally.lost,
        "wrong_tokens": tally.wrong_tokens,
        "duplicates": tally.duplicates,
        "hung": tally.hung,
        "index_converged_s": final["index_converged_s"],
        "leaks": {
            "leases": final["leases"],
            "slots": final["slots"],
            "shm": len(final["shm_before_teardown"]) + len(leftover_shm),
            "processes": len(final.get("orphans", [])),
        },
        "growth_per_hour": growth,
        **extra,
    }


def _failed(r: RequestRecord) -> bool:
    """Whether `r` breaks an invariant (False while it has no reference yet)."""
    return r.expected is not None and verdict(r) not in ("", "tie_flip")


def write_history(
    out: Path,
    schedule: Sequence[Any],
    faults: Sequence[FaultLog],
    records: Sequence[RequestRecord],
    samples: Sequence[Sample],
) -> Path:
    out.mkdir(parents=True, exist_ok=True)
    path = out / "history.jsonl"
    with path.open("w") as f:
        for s in schedule:
            f.write(json.dumps({"type": "scheduled", **s.as_dict()}) + "\n")
        for fl in faults:
            f.write(json.dumps({"type": "fault", **fl.as_dict()}) + "\n")
        for r in records:
            row = asdict(r)
            # prompts replay from the seed; a failed request's is kept, to judge it again (a real engine's
            # timing-dependent traffic may not draw it again)
            if not _failed(r):
                del row["prompt"]
            f.write(json.dumps({"type": "request", **row}) + "\n")
        for sm in samples:
            f.write(json.dumps({"type": "sample", **asdict(sm)}) + "\n")
    return path


def plot(out: Path, faults: Sequence[FaultLog], records: Sequence[RequestRecord], duration_s: float) -> Path:
    """Three panels over campaign time: requests started per second (load, pool-filling ones included), the
    faults as spans, and each request's latency (those that broke an invariant marked)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (load, spans, lat) = plt.subplots(3, 1, figsize=(14, 9), sharex=True, height_ratios=[1, 1.4, 2])
    width = int(duration_s) + 1
    per_s = [0] * width
    for r in records:
        if 0 <= int(r.started) < width:
            per_s[int(r.started)] += 1
    load.plot(range(width), per_s, lw=0.8)
    load.set_ylabel("requests/s")
    kinds = sorted({fl.fault.kind for fl in faults})
    colours = plt.get_cmap("tab10")
    for fl in faults:
        y = kinds.index(fl.fault.kind)
        spans.broken_barh([(fl.started, max(0.2, fl.ended - fl.started))], (y - 0.4, 0.8), color=colours(y % 10))
    spans.set_yticks(range(len(kinds)), kinds)
    spans.set_ylabel("faults")
    groups = {
        "fine": [r for r in records if r.kind != "fill" and not verdict(r)],
        "pool-filling load": [r for r in records if r.kind == "fill" and not verdict(r)],
        "broke an invariant": [r for r in records if verdict(r)],
    }
    styles = {
        "fine": (".", 6, "tab:blue"),
        "pool-filling load": (".", 6, "tab:gray"),
        "broke an invariant": ("x", 30, "tab:red"),
    }
    for label, group in groups.items():
        if group:
            marker, size, colour = styles[label]
            xs = [r.started for r in group]
            ys = [(r.ended or r.started) - r.started for r in group]
            lat.scatter(xs, ys, marker=marker, s=size, c=colour, label=label)
    lat.set_ylabel("latency, s")
    lat.set_xlabel("campaign time, s")
    lat.legend(loc="upper right")
    fig.tight_layout()
    out.mkdir(parents=True, exist_ok=True)
    path = out / "chaos.png"
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path
