"""The fleet evaluation, with the data-plane study's protocol: capacity per policy, one common load.

Protocol (``evaluate``), the same for every policy:

0. **Which requests count.** Requests no worker could ever serve (``ideal.unservable_reason``: prompt +
   output beyond the model's context, output above the engine's limit, prompt beyond one worker's KV pool)
   are the trace's, not a policy's: they are removed before any run, with the follow-ups chained on them,
   and reported apart (``trace_unservable``: count and reasons). Every other request of the trace (or of the
   bisection window) counts; a rejected or unfinished one is an SLO violation.
1. ``slo_capacity(p)`` for every policy p: :func:`kvmesh.fleet.capacity.bisect_capacity` over the load scale
   (start 0.5, scales in [1/64, 64], 5 % relative tolerance, at most 10 probes), each probe a run with
   ``stop_when_slo_lost`` on the bisection window (the whole trace, or its first ``bisect_window_s``
   seconds). A probe meets the SLO when no request was rejected or left unfinished and p99 of the TTFT the
   SLO judges (``metrics.Slo``) and of the ITL are inside it. A policy that never meets it has capacity 0;
   its probes (the pass/fail curve over the scale) are reported with it.
2. The common comparison load ``load_scale`` (:func:`common_load_scale`), a rule that gives a load for any
   trace: 1.25 × round_robin's capacity when it is above 0 (the fleet evaluation's rule); otherwise the highest capacity
   of a baseline (a policy other than kvmesh's) when one is above 0; otherwise ``FALLBACK_LOAD_SCALE`` (the
   trace's own arrival rate). Every policy runs the whole servable trace at that scale; its metrics
   (``metrics.summarize``, ``metrics.ttft_excess_ms`` against ``ideal``'s idle, infinite-cache TTFT) plus
   ``pooled_lru_hit_ratio`` (one LRU of the fleet's whole KV capacity, ``reference.pooled_lru_hit_ratio``)
   go to ``results.json``, with the rule that chose the load and the protocol (``protocol``).

Runs are independent processes (``jobs``); each process reads the trace once and keeps its hash cache.
"""

from __future__ import annotations

import math
import os
import sys
import time
from collections import Counter
from collections.abc import Callable, Sequence
from concurrent.futures import ProcessPoolExecutor, as_completed
from dataclasses import dataclass, replace
from typing import Any

from kvmesh.engine.sim.perf import H200_LLAMA70B_FP8, chunked_prefill_time
from kvmesh.fleet.capacity import bisect_capacity
from kvmesh.fleet.ideal import Unservable, ideal_cached_tokens, ideal_ttfts, servable_trace
from kvmesh.fleet.metrics import pct, ttft_excess_ms
from kvmesh.fleet.policies import make_policy
from kvmesh.fleet.readers import read_trace
from kvmesh.fleet.reference import ideal_hit_ratio, pooled_lru_hit_ratio
from kvmesh.fleet.sim import FleetConfig, FleetSim, HashCache, RunResult
from kvmesh.fleet.trace import Trace, spread_simultaneous


@dataclass(frozen=True, slots=True)
class Job:
    """One unit of work for a worker process."""

    kind: str  # "capacity", "run" or "search" (the best of ``candidates``, ``pd_eval.search_best``)
    policy: str
    config: FleetConfig
    window_s: float | None = None
    kvmesh_profile: str | None = None
    keep_records: bool = True
    candidates: tuple[FleetConfig, ...] = ()
    labels: tuple[str, ...] = ()


_STATE: dict[str, Any] = {}

# Bisection parameters (module docstring, step 1) and the last resort of the common load (step 2).
BISECT_START, BISECT_REL_TOL, BISECT_MAX_PROBES = 0.5, 0.05, 10
BISECT_MIN_SCALE, BISECT_MAX_SCALE = 1 / 64, 64.0
BASELINE_FACTOR = 1.25
FALLBACK_LOAD_SCALE = 1.0


def load_trace(trace_path: str) -> Trace:
    """Read a trace; a path ending in ``+spread`` also spreads simultaneous arrivals
    (``trace.spread_simultaneous``)."""
    if trace_path.endswith("+spread"):
        return spread_simultaneous(read_trace(trace_path.removesuffix("+spread")))
    return read_trace(trace_path)


def prepare_trace(trace_path: str, cfg: FleetConfig) -> tuple[Trace, Unservable]:
    """:func:`load_trace` without the requests no worker of ``cfg`` could ever serve (``ideal.servable_trace``)."""
    return servable_trace(load_trace(trace_path), cfg.engine_config())


def _init(trace_path: str, cfg: FleetConfig) -> None:
    tr, _ = prepare_trace(trace_path, cfg)
    _STATE["trace"] = tr
    _STATE["hc"] = HashCache(tr, cfg.block_size)
    _STATE["win"] = {}
    _STATE["ideal"] = {}


def ideal_ttfts_of(trace: Trace, hc: HashCache, cfg: FleetConfig) -> Any:
    """Idle, infinite-cache TTFT (s) of every request of ``trace``, indexed by request index (``ideal``)."""
    cached = ideal_cached_tokens(((r.input_len, hc.hashes(r.index)) for r in trace), cfg.block_size)
    lengths = [r.input_len for r in trace]
    return ideal_ttfts(lengths, cached, cfg.prefill_chunk_tokens, cfg.engine_config().perf)


def _ideal_for(window_s: float | None, cfg: FleetConfig) -> Any:
    got = _STATE["ideal"].get(window_s)
    if got is None:
        got = _STATE["ideal"][window_s] = ideal_ttfts_of(*_trace_for(window_s), cfg)
    return got


def _trace_for(window_s: float | None) -> tuple[Trace, HashCache]:
    tr: Trace = _STATE["trace"]
    if window_s is None:
        return tr, _STATE["hc"]
    win = _STATE["win"].get(window_s)
    if win is None:
        t = tr.window(0.0, window_s)
        win = _STATE["win"][window_s] = (t, HashCache(t, _STATE["hc"].block_size))
    return win  # type: ignore[no-any-return]


def run_job(job: Job) -> dict[str, Any]:
    """Execute a job inside a worker process (the trace was loaded by ``_init``)."""
    tr, hc = _trace_for(job.window_s)
    t0 = time.perf_counter()
    if job.kind == "search":
        return _search_job(job, tr, hc, t0)
    if job.kind == "capacity":
        probes: list[dict[str, Any]] = []

        def meets(scale: float) -> bool:
            cfg = replace(job.config, load_scale=scale, stop_when_slo_lost=True)
            r = FleetSim(tr, make_policy(job.policy, job.kvmesh_profile), cfg, hc).run()
            ok = bool(r.summary.get("meets_slo")) and not r.truncated
            probes.append({"scale": scale, "meets": ok, "stopped_early": r.stopped_early, "wall_s": round(r.wall_s, 2)})
            return ok

        cap = bisect_capacity(
            meets, BISECT_START, BISECT_REL_TOL, BISECT_MIN_SCALE, BISECT_MAX_SCALE, BISECT_MAX_PROBES
        )
        return {
            "kind": "capacity",
            "policy": job.policy,
            "slo_capacity": cap.value,
            "upper": cap.upper,
            "probes": probes,
            "wall_s": time.perf_counter() - t0,
        }
    res = FleetSim(tr, make_policy(job.policy, job.kvmesh_profile), job.config, hc).run()
    ideal = _ideal_for(job.window_s, job.config)
    return {"kind": "run", "policy": job.policy, **result_payload(res, job.keep_records, ideal)}


def _search_job(job: Job, tr: Trace, hc: HashCache, t0: float) -> dict[str, Any]:
    """The best of ``job.candidates`` by SLO capacity on the window, with the summary of its passing probe at
    that capacity (a run to the end: it met the SLO)."""
    from kvmesh.fleet.pd_eval import search_best

    summaries: dict[tuple[int, float], dict[str, Any]] = {}
    index = {id(c): i for i, c in enumerate(job.candidates)}

    def meets(cfg: FleetConfig, scale: float) -> bool:
        run = replace(cfg, load_scale=scale, stop_when_slo_lost=True)
        r = FleetSim(tr, make_policy(job.policy, job.kvmesh_profile), run, hc).run()
        ok = bool(r.summary.get("meets_slo")) and not r.truncated
        if ok:
            summaries[(index[id(cfg)], scale)] = r.summary
        return ok

    found = search_best(job.candidates, meets, BISECT_START, BISECT_REL_TOL, BISECT_MAX_PROBES)
    labels = job.labels or tuple(str(i) for i in range(len(job.candidates)))
    best = found.best
    return {
        "kind": "search",
        "policy": job.policy,
        "slo_capacity": found.capacity,
        "best": best,
        "best_label": labels[best] if best is not None else None,
        "best_summary": summaries.get((best, found.capacity)) if best is not None else None,
        "searched": [
            {"label": lb, "capacity": s.capacity, "probes": [[round(x, 4), ok] for x, ok in s.probes]}
            for lb, s in zip(labels, found.searched, strict=True)
        ],
        "wall_s": time.perf_counter() - t0,
    }


def result_payload(res: RunResult, keep_records: bool = True, ideal_ttft_s: Any = None) -> dict[str, Any]:
    """A picklable digest of a run: summary, utilisation series, per-request latencies for CDFs; with the
    requests' idle, infinite-cache TTFTs (``ideal_ttfts_of``) the summary gains ``ttft_excess_ms``."""
    if ideal_ttft_s is not None:
        res.summary["ttft_excess_ms"] = ttft_excess_ms(res.records, ideal_ttft_s)
    out: dict[str, Any] = {
        "summary": res.summary,
        "util_series": res.util_series,
        "wall_s": res.wall_s,
        "events": res.events,
    }
    if keep_records:
        done = [r for r in res.records if not math.isnan(r.finish)]
        out["ttft_s"] = [r.ttft for r in done]
        out["e2e_s"] = [r.e2e for r in done]
    return out


class Progress:
    """A text progress bar on stderr: ``[#####.....] done/total label``."""

    def __init__(self, total: int, stream: Any = sys.stderr, width: int = 30) -> None:
        self.total = max(total, 1)
        self.done = 0
        self.stream = stream
        self.width = width
        self.t0 = time.perf_counter()

    def advance(self, label: str, n: int = 1) -> None:
        self.done += n
        k = int(self.width * min(self.done, self.total) / self.total)
        el = time.perf_counter() - self.t0
        self.stream.write(f"\r[{'#' * k}{'.' * (self.width - k)}] {self.done}/{self.total} {el:6.0f}s {label[:40]:<40}")
        if self.done >= self.total:
            self.stream.write("\n")
        self.stream.flush()


def run_jobs(
    trace_path: str, cfg: FleetConfig, jobs: Sequence[Job], n_proc: int, progress: Progress | None = None
) -> list[dict[str, Any]]:
    """Run jobs in ``n_proc`` processes (in-process when 1), each with the trace servable on ``cfg``'s
    engines; results in job order."""
    out: list[dict[str, Any] | None] = [None] * len(jobs)
    if n_proc <= 1:
        _init(trace_path, cfg)
        for i, j in enumerate(jobs):
            out[i] = run_job(j)
            if progress:
                progress.advance(f"{j.kind} {j.policy}")
    else:
        with ProcessPoolExecutor(n_proc, initializer=_init, initargs=(trace_path, cfg)) as ex:
            futs = {ex.submit(run_job, j): i for i, j in enumerate(jobs)}
            for f in as_completed(futs):
                i = futs[f]
                out[i] = f.result()
                if progress:
                    progress.advance(f"{jobs[i].kind} {jobs[i].policy}")
    return [o for o in out if o is not None]


def reference_ratios(trace: Trace, cfg: FleetConfig) -> dict[str, float]:
    """pooled-LRU (fleet capacity) and infinite-cache hit ratios of a trace at the fleet's block size."""
    hc = HashCache(trace, cfg.block_size)
    prompts = [(r.input_len, hc.hashes(r.index)) for r in trace]
    per_worker = cfg.num_blocks or H200_LLAMA70B_FP8.kv_capacity_blocks(cfg.block_size)
    return {
        "pooled_lru_hit_ratio": pooled_lru_hit_ratio(prompts, cfg.block_size, per_worker * cfg.workers),
        "ideal_hit_ratio": ideal_hit_ratio(prompts, cfg.block_size),
        "fleet_kv_blocks": per_worker * cfg.workers,
    }


def absolute_slo_evidence(trace: Trace, cfg: FleetConfig) -> dict[str, float]:
    """What no router can change, from the perf model alone (idle engine, prefill chunked as configured), over
    the trace's servable requests:

    * fraction of requests whose prefill alone exceeds the TTFT SLO with an empty cache, and with an
      infinite cache (``ideal``) — above 1 %, TTFT p99 ≤ SLO is impossible;
    * ``ttft_p99_floor_ms``: p99 of those infinite-cache TTFTs, a lower bound on any policy's TTFT p99;
    * timestamp quantisation: distinct arrival times and the largest number of requests sharing one.
    """
    trace, _ = servable_trace(trace, cfg.engine_config())
    chunk = cfg.prefill_chunk_tokens
    floor = ideal_ttfts_of(trace, HashCache(trace, cfg.block_size), cfg)
    cold = sum(chunked_prefill_time(r.input_len, 0, chunk) > cfg.slo.ttft_s for r in trace)
    n = max(len(trace), 1)
    stamps = Counter(r.arrival_s for r in trace if r.follows is None)
    return {
        "cold_fraction_over_slo": cold / n,
        "infinite_cache_fraction_over_slo": float((floor > cfg.slo.ttft_s).sum()) / n,
        "ttft_p99_floor_ms": 1000 * pct(floor, 99),
        "distinct_timestamps": len(stamps),
        "max_requests_per_timestamp": max(stamps.values(), default=0),
    }


def unservable_note(gone: Unservable) -> str:
    """The report's sentence on the requests the protocol removed (module docstring, step 0)."""
    if not gone.indices:
        return "Every request of the trace can be served by a worker: none was removed."
    why = ", ".join(f"{n} {r}" for r, n in sorted(gone.reasons.items()))
    return (
        f"{len(gone.indices)} of the trace's {gone.of_requests} requests can never be served by any worker "
        f"({why}; `context`: prompt + output beyond the model's context) and {gone.followups} follow-ups "
        "chained on them: they are the trace's, not a policy's, so they were removed before every run and "
        "are excluded from SLO attainment, goodput and the reference hit ratios identically for every policy "
        "(`trace_unservable` in results.json)."
    )


def build_notes(
    full: Trace, base: FleetConfig, ev_abs: dict[str, float], unservable: Unservable | None = None
) -> list[str]:
    """The report's notes: what the trace and the perf model impose on every policy, and sim conventions."""
    head = [unservable_note(unservable)] if unservable is not None else []
    return [
        *head,
        f"Absolute TTFT SLO ({base.slo.ttft_s} s): {100 * ev_abs['cold_fraction_over_slo']:.1f} % of requests "
        f"need longer than that to prefill alone on an idle H200 with an empty cache, "
        f"{100 * ev_abs['infinite_cache_fraction_over_slo']:.1f} % even with an infinite cache "
        "(perf model `kvmesh.engine.sim.perf`, chunked at 1024 tokens). No policy can bring TTFT p99 below "
        f"{ev_abs['ttft_p99_floor_ms'] / 1000:.1f} s (p99 of the idle, infinite-cache prefill times).",
        f"Arrival quantisation: the trace has {ev_abs['distinct_timestamps']} distinct timestamps for "
        f"{len(full)} requests (up to {ev_abs['max_requests_per_timestamp']} at one instant); scaling keeps "
        "those batches simultaneous, so a policy that can place two long prompts of a batch on one worker "
        "breaks the SLO at any load.",
        "Load reports are read at decision time (no report lag) for every policy; the simulated cache-manager "
        "index applies each engine step's KV events when the step ends.",
        "Engines: `kvmesh.engine.sim.core.SimEngineCore` defaults (max_batched_tokens 8192, per-request "
        "prefill chunk 1024, KV admission ≤ 95 %, LRU eviction), KV pool from the perf model.",
    ]


def is_baseline(policy: str) -> bool:
    """A policy other than kvmesh's own (``kvmesh`` and its variants, e.g. with the data plane)."""
    return not policy.startswith("kvmesh")


def common_load_scale(capacities: dict[str, float]) -> tuple[float, str]:
    """The comparison load of step 2 of the module docstring and the rule that chose it."""
    rr = capacities.get("round_robin", 0.0)
    if rr > 0:
        return BASELINE_FACTOR * rr, f"{BASELINE_FACTOR} x round_robin's slo_capacity"
    base = {p: c for p, c in capacities.items() if is_baseline(p) and c > 0}
    if base:
        best = max(base, key=lambda p: base[p])
        return base[best], f"round_robin never meets the SLO: the best baseline's slo_capacity ({best})"
    return FALLBACK_LOAD_SCALE, (
        f"no baseline meets the SLO: {FALLBACK_LOAD_SCALE} x the trace's own arrival rate (FALLBACK_LOAD_SCALE)"
    )


def protocol(base: FleetConfig, bisect_window_s: float | None, rule: str) -> dict[str, Any]:
    """The SLO protocol, as applied to every policy (``protocol`` in results.json)."""
    return {
        "slo": {"ttft_s": base.slo.ttft_s, "itl_s": base.slo.itl_s, "ttft_mode": base.slo.ttft_mode, "percentile": 99},
        "bisect_window_s": bisect_window_s,
        "bisect": {
            "start": BISECT_START,
            "rel_tol": BISECT_REL_TOL,
            "max_probes": BISECT_MAX_PROBES,
            "scale_range": [BISECT_MIN_SCALE, BISECT_MAX_SCALE],
        },
        "counted_requests": (
            "every servable request of the window (whole trace at load_scale); a rejected or unfinished one "
            "is a violation; trace_unservable requests are removed for every policy"
        ),
        "load_scale_rule": rule,
    }


def _pcts(summary: dict[str, Any], key: str, names: Sequence[str]) -> dict[str, float]:
    """Percentiles ``names`` of ``summary[key]``; NaN where a run had no finished request."""
    got = summary.get(key, {})
    return {k: got.get(k, math.nan) for k in names}


def evaluate(
    trace_path: str,
    policies: Sequence[str],
    base: FleetConfig,
    bisect_window_s: float | None = None,
    n_proc: int = 1,
    kvmesh_profile: str | None = None,
    log: Callable[[str], None] = lambda s: None,
) -> dict[str, Any]:
    """Steps 0–2 of the module docstring; returns results (contract keys) and the raw material of the report."""
    pols = list(policies)
    if "round_robin" not in pols:
        pols.insert(0, "round_robin")
    cap_jobs = [Job("capacity", p, base, bisect_window_s, kvmesh_profile, False) for p in pols]
    prog = Progress(2 * len(pols))
    caps = {c["policy"]: c for c in run_jobs(trace_path, base, cap_jobs, n_proc, prog)}
    load_scale, rule = common_load_scale({p: c["slo_capacity"] for p, c in caps.items()})
    log(f"load_scale = {load_scale:.4f} ({rule})")
    cfg = replace(base, load_scale=load_scale)
    runs = {
        r["policy"]: r
        for r in run_jobs(trace_path, base, [Job("run", p, cfg, None, kvmesh_profile) for p in pols], n_proc, prog)
    }
    full, gone = prepare_trace(trace_path, base)
    ref = reference_ratios(full, base)
    ev_abs = absolute_slo_evidence(full, base)
    notes = build_notes(full, base, ev_abs, gone)
    results: dict[str, Any] = {
        "load_scale": load_scale,
        "load_scale_rule": rule,
        "trace_unservable": gone.as_dict(),
        "protocol": protocol(base, bisect_window_s, rule),
    }
    for p in pols:
        s = runs[p]["summary"]
        results[p] = {
            "slo_capacity": caps[p]["slo_capacity"],
            "slo_probes": [{"scale": q["scale"], "meets": q["meets"]} for q in caps[p]["probes"]],
            "ttft_ms": _pcts(s, "ttft_ms", ("p50", "p90", "p99")),
            "ttft_excess_ms": _pcts(s, "ttft_excess_ms", ("p50", "p90", "p99")),
            "e2e_ms": _pcts(s, "e2e_ms", ("p50", "p99")),
            "pooled_lru_hit_ratio": ref["pooled_lru_hit_ratio"],
            **{k: s.get(k, math.nan) for k in ("hit_ratio", "output_tokens_per_s", "goodput", "util_variance")},
        }
    return {
        "results": results,
        "capacities": caps,
        "runs": runs,
        "reference": ref,
        "config": base,
        "bisect_window_s": bisect_window_s,
        "cpu_count": os.cpu_count(),
        "absolute_slo": ev_abs,
        "notes": notes,
        "trace_unservable": gone.as_dict(),
    }
