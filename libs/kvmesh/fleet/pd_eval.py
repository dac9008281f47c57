"""The P/D evaluation's searches: the best prefill:decode split at a fixed number of GPUs, and the aggregated
fleet's best per-step token budget (the operator's ``max_num_batched_tokens``), both by SLO capacity.

``search_best(candidates, meets)`` returns the candidate with the highest SLO capacity, each capacity by the
fleet evaluation's bisection (``capacity.bisect_capacity``, start 0.5, 5 %, ≤ 10 probes). A candidate after
the first is first probed at ``best · (1 + rel_tol)``: if it fails there it cannot beat the best by more than
the tolerance (``meets`` is monotone in the load), so it costs one probe and is reported as not beating it;
else its bisection starts there. Probes are memoised per (candidate, scale).

The aggregated fleet's candidates (:data:`CHUNK_CANDIDATES`) are (step budget, per-request chunk) pairs: the
engine's default (8192, 1024) and budgets down to 256, as vLLM's ``max_num_batched_tokens`` bounds a step's
tokens (at 0.143 ms of prefill per token a 1,024-token chunk alone holds a step for ~146 ms). Every candidate
is judged with the same TTFT allowance (``FleetConfig.allowance_chunk_tokens`` = 1024).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace
from typing import Any, Generic, TypeVar

from kvmesh.fleet.capacity import bisect_capacity
from kvmesh.fleet.pd import PdFleet
from kvmesh.fleet.sim import FleetConfig

T = TypeVar("T")

CHUNK_CANDIDATES: tuple[tuple[int, int], ...] = ((8192, 1024), (2048, 1024), (1024, 1024), (512, 512), (256, 256))
ALLOWANCE_CHUNK = 1024
SEARCH_START, SEARCH_REL_TOL, SEARCH_MAX_PROBES = 0.5, 0.05, 10


@dataclass(slots=True)
class Searched(Generic[T]):
    """One candidate's outcome: its capacity (None: it failed at the gate, i.e. it does not beat the best)."""

    candidate: T
    capacity: float | None
    probes: list[tuple[float, bool]] = field(default_factory=list)


@dataclass(slots=True)
class SearchResult(Generic[T]):
    best: int | None  # index of the best candidate (None: none met the SLO at any probed load)
    capacity: float
    searched: list[Searched[T]]


def search_best(
    candidates: Sequence[T],
    meets: Callable[[T, float], bool],
    start: float = SEARCH_START,
    rel_tol: float = SEARCH_REL_TOL,
    max_probes: int = SEARCH_MAX_PROBES,
) -> SearchResult[T]:
    """The module docstring's search."""
    best: int | None = None
    cap = 0.0
    out: list[Searched[T]] = []
    for i, c in enumerate(candidates):
        memo: dict[float, bool] = {}
        probes: list[tuple[float, bool]] = []

        def probe(
            s: float, c: T = c, memo: dict[float, bool] = memo, probes: list[tuple[float, bool]] = probes
        ) -> bool:
            if s not in memo:
                memo[s] = meets(c, s)
                probes.append((s, memo[s]))
            return memo[s]

        first = start
        if cap > 0:
            first = cap * (1.0 + rel_tol)
            if not probe(first):
                out.append(Searched(c, None, probes))
                continue
        got = bisect_capacity(probe, start=first, rel_tol=rel_tol, max_iter=max_probes)
        out.append(Searched(c, got.value, probes))
        if got.value > cap:
            best, cap = i, got.value
    return SearchResult(best, cap, out)


def default_splits(workers: int) -> list[int]:
    """Prefill worker counts x tried at ``workers`` GPUs: a quarter to seven eighths in quarters, then 0 (no
    prefill pool: the aggregated fleet, the split for a trace that gains nothing). 0 comes last so that the
    best split with a prefill pool is bisected, not gated, and reported as ``disaggregated_slo_capacity``."""
    step = max(1, workers // 4)
    return [*(x for x in range(max(1, workers // 4), workers, step)), 0]


def chunk_configs(base: FleetConfig, candidates: Sequence[tuple[int, int]] = CHUNK_CANDIDATES) -> list[FleetConfig]:
    """The aggregated fleet at each (step budget, chunk), all judged with the same allowance."""
    return [
        replace(base, max_batched_tokens=b, prefill_chunk_tokens=min(c, b), allowance_chunk_tokens=ALLOWANCE_CHUNK)
        for b, c in candidates
    ]


def split_configs(base: FleetConfig, decider: str, splits: Sequence[int], link_gbps: float) -> list[FleetConfig]:
    """The P/D fleet at each split x (x prefill workers of ``base.workers``) under ``decider``."""
    return [replace(base, pd=PdFleet(x, decider, link_gbps), allowance_chunk_tokens=ALLOWANCE_CHUNK) for x in splits]


def pd_entry(found: dict[str, Any]) -> dict[str, Any]:
    """results.json's ``pd`` block of one policy from a search job's answer (``evaluate.run_job``)."""
    s = found.get("best_summary") or {}
    pd = s.get("pd", {})
    pools = [c["capacity"] for c in found["searched"] if not c["label"].startswith("0P") and c["capacity"] is not None]
    return {
        "slo_capacity": found["slo_capacity"],
        "disaggregated_slo_capacity": max(pools, default=0.0),
        "split": pd.get("split", found.get("best_label")),
        "disagg_share": pd.get("disagg_share"),
        "handoff_ms": pd.get("handoff_ms", {"p50": None, "p99": None}),
        "fallbacks": pd.get("fallbacks"),
        "reasons": pd.get("reasons", {}),
        "link_gbps": pd.get("link_gbps"),
        "itl_p99_ms": s.get("itl_ms", {}).get("p99"),
        "ttft_over_allowance_p99_ms": s.get("ttft_over_allowance_ms_p99"),
        "hit_ratio": s.get("hit_ratio"),
        "splits": [
            {"split": c["label"], "slo_capacity": c["capacity"], "probes": c["probes"]} for c in found["searched"]
        ],
    }
