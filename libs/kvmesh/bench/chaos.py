"""``python -m kvmesh.bench chaos --duration-s 600 --seed 1 [--out DIR]``: a randomised fault campaign over
a two-zone suite under steady mixed traffic, its invariants checked over the whole history.

The suite (`kvmesh.bench.chaos_suite`): two zones in network namespaces (needs root), each a cache-manager,
`--workers-per-zone` simulated workers computing in real time (`--sim-speed`), a router (authorisation
enforced) and a failover service, linked by the emulated inter-zone link; the Consul stand-in. The schedule
(`kvmesh.bench.chaos_schedule`, from `--seed` alone) injects every fault kind at least once, overlapping by
its rule, in ``[--warmup-s, --duration-s - --settle-s)``; the traffic (`kvmesh.bench.chaos_traffic`, also
from the seed) runs from 0 to `--duration-s - --settle-s / 2`, so every fault meets requests in flight and
the last requests meet a quiet suite. Then the final pass (`kvmesh.bench.chaos_runner`), the teardown, and one
JSON line:

    {"seed", "duration_s", "faults": {KIND: count}, "requests", "succeeded", "retried_ok", "lost",
     "wrong_tokens", "duplicates", "hung", "index_converged_s", "leaks": {"leases", "slots", "shm"},
     "growth_per_hour": {TARGET: {"rss_mb", "fds", "threads", "tasks"}}, "engine", "references", "tie_flips", ...}

plus ``shed`` (arrivals not sent: the in-flight bound was reached), ``fills`` (pool-filling requests),
``failed_non_retryable``, ``drain_violations``, ``integrity_violations`` (a corrupted block delivered by a
pull, a checkpoint into a full store that did not fail cleanly), ``checkpoint_errors`` (a checkpoint asked
of each cache-manager after the last fault), ``not_serving``, ``index_differences``, ``dump_orphans``
(workers whose full dump holds blocks without their parent, how many). The schedule, one line per fault,
and the history of every request that broke an invariant go to stderr (the run replays from its seed).
`--out DIR` gets ``history.jsonl`` and ``chaos.png`` (load, faults, latency over time). ``leaks.processes``
(``orphans``, named) counts the processes a suite process started (vLLM's engine core and workers) that
outlived it: seen every sample, checked before the teardown, killed after it.

``pd_counters`` sums the routers' prefill/decode decisions, handed-over blocks and fallbacks. ``--pd`` makes
each zone's worker-0 a prefill worker and the others decode workers, so that long prompts are handed over
between them while the faults land. ``--soak`` runs the same suite and traffic with no fault: the growth per
hour of each process (RSS, its share of the process's RSS as ``rss_pct``, fds, threads) after `--growth-
warmup-s` is the soak's figure.

``--vllm`` makes every worker a real vLLM engine serving the tiny model (`scripts/build_tiny_model.py`; eager,
its KV pool as small as the simulated workers'), the routers tokenising with its tokenizer. Prompts then stay
inside its vocabulary and every request is greedy (no ``n2``: `kvmesh.bench.chaos_traffic` says why), so that
each has one right answer wherever it runs and however often it moves; those answers come from the reference
run after the last fault (`kvmesh.bench.chaos_reference`), and ``tie_flips`` counts the requests that differ
from it only by taking another token of a near tie, the rest recomputed from there (the engine's arithmetic,
not kvmesh)."""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from kvmesh.bench import chaos_report as report
from kvmesh.bench.chaos_check import history, tally, verdict
from kvmesh.bench.chaos_reference import WorkerText, confirm_flips, fill_references
from kvmesh.bench.chaos_runner import Campaign, final_pass, kill_descendants, remove_shm, routers_ready, shm_of
from kvmesh.bench.chaos_schedule import counts, make_schedule
from kvmesh.bench.chaos_suite import SuiteConfig, start_suite, stop_suite
from kvmesh.bench.chaos_traffic import Traffic, TrafficConfig
from kvmesh.core.modelfiles import resolve_model_dir
from kvmesh.engine.tokenizer import HfTokenizer

ROUTERS_READY_S = 300.0  # until each router routes to all its workers (vLLM workers' warm-up on a busy host)


def vllm_model() -> Path:
    """The tiny model's folder (`scripts/build_tiny_model.py`)."""
    found = resolve_model_dir("")
    if found is None:
        raise SystemExit("chaos bench --vllm: no model folder; build it with scripts/build_tiny_model.py")
    return found


def vocab(model: str) -> int:
    """The model's vocabulary size (0: no model, the simulated workers)."""
    return HfTokenizer(model).vocab_size if model else 0


def log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


async def run(a: argparse.Namespace) -> dict[str, Any]:
    schedule = (
        []
        if a.soak
        else make_schedule(a.seed, a.duration_s, ("a", "b"), a.workers_per_zone, a.warmup_s, a.settle_s, a.mean_gap_s)
    )
    log(f"chaos: seed {a.seed}, {len(schedule)} faults{' (a soak: the traffic alone)' if a.soak else ''}:")
    for f in schedule:
        log("  " + f.line())
    tmp = Path(tempfile.mkdtemp(prefix="kvmesh-bench-chaos-"))
    model = str(vllm_model()) if a.vllm else ""
    config = SuiteConfig(workers_per_zone=a.workers_per_zone, sim_speed=a.sim_speed, pd=a.pd, model=model)
    suite = None
    traffic: Traffic | None = None
    campaign: Campaign | None = None
    references = 0
    try:
        suite = await start_suite(tmp, config)
        await routers_ready(suite, ROUTERS_READY_S)
        traffic_config = TrafficConfig(
            a.seed, a.rps, a.max_in_flight, a.deadline_s, seeded_sessions=a.seeded_sessions, real_vocab=vocab(model)
        )
        traffic = Traffic(suite, traffic_config, 0.0)
        await traffic.start()
        t0 = time.monotonic()
        traffic.t0 = t0
        campaign = Campaign(suite, traffic, t0)
        traffic_end = a.duration_s - a.settle_s / 2
        online = asyncio.create_task(watch_online(traffic))
        await asyncio.gather(
            traffic.run(traffic_end),
            campaign.run_faults(schedule),
            campaign.sample_every(a.sample_s, a.duration_s),
        )
        online.cancel()
        log(f"chaos: traffic and faults over at t={campaign.now():.1f}s; final pass")
        final = await final_pass(suite)
        final["orphans"] = campaign.orphans()
        if model:
            log("chaos: the reference run (each distinct request once more, greedy, on a settled worker)")
            references = await fill_references(suite.address("a/worker-0"), traffic.records)
            flips = await confirm_flips(suite.address("a/worker-0"), traffic.records, WorkerText(model))
            log(f"chaos: {references} references; {flips} differences confirmed as near-tie turns")
        await traffic.close()
        traffic = None
    finally:
        if traffic is not None:
            await traffic.close()
        if suite is not None:
            await asyncio.to_thread(stop_suite, suite)
        if campaign is not None:
            kill_descendants(campaign.descendants)  # what the suite's processes left running (counted above)
    leftover = shm_of(suite.pids)
    remove_shm(final["shm_before_teardown"] + leftover)
    t, bad = tally(campaign.traffic.records)
    for r in bad:
        log(history(r))
    for v in campaign.drain_violations:
        log(f"rogue drain: {v}")
    for v in campaign.integrity_violations:
        log(f"integrity: {v}")
    growth_warmup_s = a.growth_warmup_s if a.growth_warmup_s is not None else 300.0 if a.soak else a.warmup_s + 30
    growth = report.growth_per_hour(campaign.samples, growth_warmup_s)
    extra = {
        "engine": "vllm" if model else "sim",
        "references": references,
        "tie_flips": t.tie_flips,
        "pd": a.pd,
        "pd_counters": campaign.pd_totals(),
        "soak": a.soak,
        "growth_warmup_s": growth_warmup_s,
        "shed": campaign.traffic.shed,
        "fills": t.fills,
        "failed_non_retryable": t.failed_non_retryable,
        "drain_violations": len(campaign.drain_violations),
        "integrity_violations": len(campaign.integrity_violations),
        "checkpoint_errors": final["checkpoint_errors"],
        "not_serving": final["not_serving"],
        "index_differences": final["index_differences"][:10],
        "dump_orphans": final["dump_orphans"][:10],
        "shm_left": final["shm_before_teardown"] + leftover,
        "orphans": final.get("orphans", [])[:10],
    }
    result = report.result_line(a.seed, a.duration_s, counts(schedule), t, final, leftover, growth, extra)
    if a.out:
        out = Path(a.out)
        report.write_history(out, schedule, campaign.faults, campaign.traffic.records, campaign.samples)
        report.plot(out, campaign.faults, campaign.traffic.records, a.duration_s)
    return result


async def watch_online(traffic: Traffic, every_s: float = 1.0) -> None:
    """The online check: each request that has ended and broke an invariant is printed (with its history)
    as soon as it is seen, not only in the final pass."""
    seen = 0
    while True:
        await asyncio.sleep(every_s)  # the check's period
        records = traffic.records
        while seen < len(records) and records[seen].ended is not None:
            r = records[seen]
            if r.expected is not None and verdict(r) not in ("", "tie_flip"):
                log(f"chaos: invariant broken at t={r.ended:.2f}s\n{history(r)}")
            seen += 1


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        prog="python -m kvmesh.bench chaos", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--seed", type=int, default=1)
    p.add_argument("--duration-s", type=float, default=600.0)
    p.add_argument("--workers-per-zone", type=int, default=None, help="default 2, with --pd 3")
    p.add_argument("--rps", type=float, default=3.0, help="base arrival rate (x10 during a burst)")
    p.add_argument("--max-in-flight", type=int, default=24, help="requests open at once at most")
    p.add_argument("--deadline-s", type=float, default=30.0, help="each request's deadline, retries included")
    p.add_argument("--sim-speed", type=float, default=1.0, help="the simulated workers' time speed-up (> 0)")
    p.add_argument("--warmup-s", type=float, default=5.0, help="no fault before")
    p.add_argument("--settle-s", type=float, default=20.0, help="no fault in the last this many seconds")
    p.add_argument("--mean-gap-s", type=float, default=6.0, help="mean time between fault starts")
    p.add_argument("--sample-s", type=float, default=5.0, help="soak sampling period")
    p.add_argument(
        "--pd",
        action="store_true",
        help="prefill/decode disaggregation: each zone's worker-0 a prefill worker, the others decode workers",
    )
    p.add_argument(
        "--soak",
        action="store_true",
        help="no faults: the same traffic for the whole run, to measure each process's growth per hour",
    )
    p.add_argument(
        "--growth-warmup-s",
        type=float,
        default=None,
        help="seconds of each process instance's life left out of its growth figure (default: 300 with --soak, "
        "else --warmup-s + 30)",
    )
    p.add_argument(
        "--seeded-sessions",
        action="store_true",
        help="multi-turn sessions carry a sampling seed (default: greedy with none, as a chat client sends them)",
    )
    p.add_argument(
        "--vllm",
        action="store_true",
        help="every worker a real vLLM engine (the tiny model); tokens checked against a reference run after it",
    )
    p.add_argument("--out", default="", help="folder for history.jsonl and chaos.png")
    a = p.parse_args(argv)
    if a.workers_per_zone is None:
        a.workers_per_zone = 3 if a.pd else 2
    if a.sim_speed <= 0:
        p.error("--sim-speed must be > 0: requests must take time to overlap the faults")
    if a.workers_per_zone < 2:
        p.error("--workers-per-zone must be >= 2: the rogue planner's drain needs a floor to stop at")
    if a.pd and a.workers_per_zone < 3:
        p.error(
            "--workers-per-zone must be >= 3 with --pd: a prefill worker serves no request alone, so each zone "
            "needs two decode workers for one worker's fault to leave it serving (the schedule's overlap rule)"
        )
    if not a.soak:
        try:
            make_schedule(a.seed, a.duration_s, ("a", "b"), a.workers_per_zone, a.warmup_s, a.settle_s, a.mean_gap_s)
        except ValueError as e:
            p.error(f"--duration-s: {e}")
    print(json.dumps(asyncio.run(run(a))), flush=True)
    return 0
