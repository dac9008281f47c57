"""Value types of the routing pipeline: what the router knows about a worker, a request, a decision.

Everything here is plain data: no I/O, no clock. A `WorkerView` is the router's snapshot of one worker
(its last load report plus the router's own in-flight accounting); a `RoutingQuery` is one request as the
pipeline sees it (token count, block hashes, per-worker prefix overlap from the index); a `Decision` is the
outcome with every scorer's term per candidate, for DEBUG logs and trace spans.
"""

from __future__ import annotations

import enum
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

import numpy as np
import numpy.typing as npt

from kvmesh.core.handoff import WorkerRole
from kvmesh.core.kvevents import LoadReport

DEFAULT_PULL_MARGIN = 2.0  # a pull must beat recomputing its blocks by this factor (kvmesh.routing.dataplane)


class CircuitState(enum.StrEnum):
    """Circuit-breaker state of a worker as the pipeline sees it (see `kvmesh.routing.circuit`)."""

    CLOSED = "closed"
    OPEN = "open"
    HALF_OPEN = "half_open"


@dataclass(frozen=True, slots=True)
class TransferCosts:
    """What it costs worker w to obtain a KV block other than by prefill, in seconds (see
    `kvmesh.routing.dataplane`), derived from engine and link figures (`dataplane.TransferFigures`). The fleet
    simulator derives them from its perf model; a live router takes them from the worker's GetInfo
    (`KvTransferCosts`, its engine's `Engine.transfer_costs`: a sim worker's perf model, a vLLM worker's
    measured figures, `kvmesh.routing.dataplane.vllm_cpu_costs`).

    `prefill_s_per_token`: prefill time per prompt token; `block_load_s`: one block from w's own CPU tier
    into its engine pool (bytes / host→GPU bandwidth); `block_pull_s`: one block from a peer (bytes /
    network bandwidth); `pull_rtt_s`: the round trip a pull pays once before its bytes flow.
    """

    prefill_s_per_token: float
    block_load_s: float
    block_pull_s: float
    pull_rtt_s: float


@dataclass(slots=True)
class WorkerView:
    """The router's view of one worker. Latencies in ms, usage in [0, 1], token counts in tokens.

    `inflight_*` are the router's own assignments not yet visible in the worker's last load report
    (maintained by `kvmesh.routing.inflight.InflightTracker`); `inflight_requests` counts all of this
    router's outstanding requests on the worker (used by the anti-herding tie-break); `ended_requests` those of
    this router's requests in the last report that have ended since (the report's counts still hold them).
    `pool` is "" (any prompt), "long" or "short" (see `filters.pool`). `transfer` is None unless the fleet has
    a KV data plane (tiers, peer pulls): then the cost prices loads and pulls with it (the live router takes it
    from the worker's GetInfo). `role` is its part in prefill/decode disaggregation (`kvmesh.routing.disagg`),
    `host` and `rack` its topology labels (empty: unknown), `engine_handoff` whether it hands KV over by its
    engine's own transfer (vLLM's NixlConnector) besides kv-sync.
    """

    id: str
    zone: str = ""
    version: str = ""
    pool: str = ""
    role: WorkerRole = WorkerRole.BOTH
    host: str = ""
    rack: str = ""
    engine_handoff: bool = False
    healthy: bool = True
    draining: bool = False
    circuit: CircuitState = CircuitState.CLOSED
    # where the worker serves its CPU tier to peers (GetInfo; "" = none): only such a worker is a pull source
    kvsync_address: str = ""
    tier_region: str = ""
    tier_shm_name: str = ""
    # fields of the last load report
    running: int = 0
    waiting: int = 0
    max_queue: int = 0
    kv_usage: float = 0.0
    kv_blocks_total: int = 0
    prefill_tokens_queued: int = 0
    decode_tokens_active: int = 0
    decode_latency_p50_ms: float = 0.0
    decode_latency_p95_ms: float = 0.0
    prefix_hit_rate: float = 0.0
    error_rate: float = 0.0
    report_ts: float = 0.0
    # the router's own in-flight accounting
    inflight_prefill_tokens: int = 0
    inflight_decode_tokens: int = 0
    inflight_kv_blocks: int = 0
    inflight_requests: int = 0
    ended_requests: int = 0
    # the KV data plane's link costs (None: no data plane, prefix hits come from the GPU pool only)
    transfer: TransferCosts | None = None

    @property
    def routable(self) -> bool:
        """Whether a profile may pick this worker at all: healthy, not draining, circuit not open."""
        return self.healthy and not self.draining and self.circuit is not CircuitState.OPEN

    def apply_report(self, report: LoadReport) -> None:
        """Copy the load-report fields of `report` into this view (in place)."""
        self.running = report.running
        self.waiting = report.waiting
        self.max_queue = report.max_queue
        self.kv_usage = report.kv_usage
        self.kv_blocks_total = report.kv_blocks_total
        self.prefill_tokens_queued = report.prefill_tokens_queued
        self.decode_tokens_active = report.decode_tokens_active
        self.decode_latency_p50_ms = report.decode_latency_p50_ms
        self.decode_latency_p95_ms = report.decode_latency_p95_ms
        self.prefix_hit_rate = report.prefix_hit_rate
        self.error_rate = report.error_rate
        self.report_ts = report.timestamp


@dataclass(slots=True)
class RoutingQuery:
    """What the routing pipeline is asked about one request (the router's `RouterRequest` seen through its block
    hashes and the index's matches; the fleet simulator builds the same from a trace request).

    `matches[w]` is the number of leading blocks of `block_hashes` that worker w already caches (from
    the prefix index); the cached overlap in tokens is `min(matches[w] * block_size, prompt_tokens)`.
    With a KV data plane, `tier_matches[w]` (≥ `matches[w]`) counts the leading blocks w holds in its GPU pool
    or its own CPU/disk tier (the index's per-(worker, block) medium), and `peer_pulls` says whether w may pull
    the blocks it lacks from the peer holding the longest prefix (see `kvmesh.routing.dataplane`): of
    `pull_sources` (tier_matches of the workers that may serve a pull) when set, else of every worker.
    A pull must beat recomputing by `pull_margin` (≤ 0: never pull).
    """

    request_id: str
    prompt_tokens: int
    block_hashes: Sequence[int] | npt.NDArray[np.uint64] = ()
    matches: Mapping[str, int] = field(default_factory=dict)
    block_size: int = 16
    session_id: str = ""
    max_tokens: int = 256
    tier_matches: Mapping[str, int] = field(default_factory=dict)
    peer_pulls: bool = False
    pull_sources: Mapping[str, int] | None = None
    pull_margin: float = DEFAULT_PULL_MARGIN

    def overlap_tokens(self, worker_id: str) -> int:
        """Prompt tokens already cached on `worker_id`: min(matched_blocks * block_size, prompt_tokens)."""
        m = self.matches.get(worker_id, 0)
        return min(m * self.block_size, self.prompt_tokens) if m else 0


@dataclass(slots=True)
class Decision:
    """The pipeline's answer. `worker_id` is None when a filter left no candidate (`rejected_by` names it).

    `candidates[i]` has combined cost `totals[i]` (lower is better) and per-scorer normalised terms
    `terms[scorer][i]`; `removed` counts the workers each filter removed; `prefix` holds the chosen worker's
    prefix plan (GPU, load and pull blocks, source, seconds; set by the live router). Dict views are built
    lazily so the hot path does not pay for them.
    """

    request_id: str
    worker_id: str | None
    candidates: tuple[str, ...] = ()
    totals: Sequence[float] = ()
    terms: dict[str, Sequence[float]] = field(default_factory=dict)
    removed: dict[str, int] = field(default_factory=dict)
    rejected_by: str = ""
    picker: str = ""
    prefix: dict[str, object] = field(default_factory=dict)  # the chosen worker's prefix plan, when priced

    def scores(self) -> dict[str, float]:
        """Combined cost per candidate worker."""
        return dict(zip(self.candidates, self.totals, strict=True))

    def chosen_terms(self) -> dict[str, float]:
        """Every scorer's term and the total for the chosen worker (empty if none was chosen)."""
        if self.worker_id is None or self.worker_id not in self.candidates:
            return {}
        i = self.candidates.index(self.worker_id)
        out = {name: float(vals[i]) for name, vals in self.terms.items()}
        if self.totals:
            out["total"] = float(self.totals[i])
        return out

    def to_log(self) -> dict[str, object]:
        """A JSON-able summary for DEBUG logs and span attributes."""
        return {
            "request_id": self.request_id,
            "worker": self.worker_id,
            "picker": self.picker,
            "rejected_by": self.rejected_by,
            "removed": dict(self.removed),
            "chosen": self.chosen_terms(),
            "scores": {w: round(t, 6) for w, t in self.scores().items()},
            "prefix": dict(self.prefix),
        }
