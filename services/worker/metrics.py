"""Worker Prometheus metrics (one worker per process)."""

from __future__ import annotations

from prometheus_client import Counter, Gauge, Histogram

from kvmesh.core.errors import InvalidArgument
from kvmesh.core.generation import Usage
from kvmesh.core.kvevents import LoadReport
from kvmesh.core.pull import PullOutcome

_TTFT_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2, 5, 10, 30, 60, 120)
_ITL_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.02, 0.05, 0.1, 0.25, 0.5, 1, 2.5)

TTFT = Histogram("kvmesh_worker_ttft_seconds", "Time to first token", buckets=_TTFT_BUCKETS)
ITL = Histogram("kvmesh_worker_inter_token_latency_seconds", "Time between streamed tokens", buckets=_ITL_BUCKETS)
PREFILL_TOKENS = Counter("kvmesh_prefill_tokens_total", "Prompt tokens computed (prompt minus prefix-cache hits)")
DECODE_TOKENS = Counter("kvmesh_decode_tokens_total", "Tokens generated")
PROMPT_TOKENS = Counter("kvmesh_worker_prompt_tokens_total", "Prompt tokens received")
PREFIX_HIT_TOKENS = Counter("kvmesh_worker_prefix_hit_tokens_total", "Prompt tokens served from the prefix cache")
REQUESTS = Counter("kvmesh_worker_requests_total", "Finished generation requests", ["finish_reason"])
KV_USAGE = Gauge("kvmesh_worker_kv_usage_ratio", "Fraction of KV blocks referenced by running requests")
QUEUE = Gauge("kvmesh_worker_queue_length", "Requests waiting for admission")
RUNNING = Gauge("kvmesh_worker_running_requests", "Requests running")
PREFIX_HIT_RATE = Gauge("kvmesh_worker_prefix_hit_rate", "Prompt tokens hit in the prefix cache / prompt tokens")
KV_EVENT_SEQ = Gauge("kvmesh_worker_kv_event_sequence", "Last KV event batch sequence number")
KV_PULL_HINTS = Counter("kvmesh_worker_kv_pull_hints_total", "Pull hints followed, by whether blocks came", ["pulled"])
KV_PULL_OUTCOMES = Counter(
    "kvmesh_worker_kv_pull_outcomes_total",
    "Pull hints by outcome (vLLM: leased, remote, remote_partial, missing, failed, expired, remote_unsupported;"
    " sim: pulled, held, missing, mismatch, void, failed, timeout, unsupported)",
    ["outcome"],
)
KVSYNC_CARRIED_LEASES = Counter(
    "kvmesh_kvsync_carried_leases_total",
    "Pulls that carried a lease taken next to their source (a replicated prefix's), by outcome: used (read"
    " under it, no lease call of its own), expired, mismatch (other blocks or region), stale (leased again)",
    ["outcome"],
)
TIER_BLOCKS = Gauge("kvmesh_worker_tier_blocks", "KV blocks held in the host tiers (CPU and disk)")
TIER_LOADED_TOKENS = Gauge("kvmesh_worker_tier_loaded_tokens", "Prompt tokens loaded back from the host tiers")
TIER_PULLED_BLOCKS = Gauge("kvmesh_worker_tier_pulled_blocks", "KV blocks pulled from peers into the CPU tier")
BATCHING_WAIT = Histogram(
    "kvmesh_worker_batching_wait_seconds",
    "Time a request waited in the batching window before entering the engine",
    buckets=(0.01, 0.025, 0.05, 0.1, 0.15, 0.2, 0.3, 0.5, 1, 2, 5),
)
BATCHING_RELEASE = Histogram(
    "kvmesh_worker_batching_release_requests",
    "Requests one release of the batching window let into the engine",
    buckets=(1, 2, 4, 8, 16, 32, 64, 128, 256),
)
GENERATE_FRAMES_CONNECTIONS = Gauge(
    "kvmesh_worker_generate_frames_connections", "Open generate-frames connections (the routers' opt-in transport)"
)
GENERATE_FRAMES_REFUSED = Counter(
    "kvmesh_worker_generate_frames_refused_total",
    "Generate-frames connections closed by the worker, by reason (denied, version, malformed, too_large)",
    ["reason"],
)
HANDOFF_HOLDS = Gauge(
    "kvmesh_worker_handoff_holds", "Prefill halves whose KV this worker holds for a decode worker now"
)
HANDOFF_HELD_BLOCKS = Gauge(
    "kvmesh_worker_handoff_held_blocks", "Tier blocks held for decode workers now (prefill halves' handoffs)"
)
HANDOFFS = Counter(
    "kvmesh_worker_handoffs_total",
    "Prefill halves' holds by how they ended: collected (a decode worker leased the blocks) or expired (none"
    " came within the hold)",
    ["outcome"],
)
HANDOFF_BYTES = Counter(
    "kvmesh_worker_handoff_bytes_total", "Bytes of held KV blocks decode workers collected (prefill halves)"
)
GPUS = Gauge("kvmesh_worker_gpus", "GPUs this worker occupies (--gpus)")
GPU_HOUR_PRICE = Gauge("kvmesh_worker_gpu_hour_price_usd", "Configured price of one GPU-hour, USD (--gpu-hour-price)")


def set_cost(gpus: int, gpu_hour_price: float) -> None:
    """The worker's configured cost: deploy/prometheus/alerts.yaml turns it into cost per hour and per million
    tokens (recording rules), so no cost is computed here."""
    if gpus < 1:
        raise InvalidArgument("gpus", f"must be at least 1, got {gpus}")
    if not gpu_hour_price >= 0:
        raise InvalidArgument("gpu_hour_price", f"must be a price in USD >= 0, got {gpu_hour_price}")
    GPUS.set(gpus)
    GPU_HOUR_PRICE.set(gpu_hour_price)


def observe_finished(usage: Usage | None, finish_reason: str | None) -> None:
    REQUESTS.labels(finish_reason or "unknown").inc()
    if usage is None:
        return
    PROMPT_TOKENS.inc(usage.prompt_tokens)
    PREFIX_HIT_TOKENS.inc(usage.cached_tokens)
    PREFILL_TOKENS.inc(max(0, usage.prompt_tokens - usage.cached_tokens))
    DECODE_TOKENS.inc(usage.completion_tokens)


def observe_load(r: LoadReport) -> None:
    KV_USAGE.set(r.kv_usage)
    QUEUE.set(r.waiting)
    RUNNING.set(r.running)
    PREFIX_HIT_RATE.set(r.prefix_hit_rate)
    if "tier_blocks" in r.extra:
        TIER_BLOCKS.set(r.extra["tier_blocks"])
        TIER_LOADED_TOKENS.set(r.extra.get("tier_loaded_tokens_total", 0.0))
        TIER_PULLED_BLOCKS.set(r.extra.get("tier_pulled_blocks_total", 0.0))
    _observe_engine_handoffs(r.extra)


ENGINE_HANDOFFS = Gauge(
    "kvmesh_worker_engine_handoffs",
    "Prefill/decode handoffs by the engine's own transfer (vLLM's NixlConnector), since the engine started:"
    " sent, received, refused, void (past their hold), fallbacks (computed instead)",
    ["event"],
)
NIXL = Gauge(
    "kvmesh_worker_nixl",
    "vLLM's NixlConnector's counts since the engine started (transfers, bytes, failed_transfers,"
    " failed_handshakes, expired: prefill blocks its lease freed that no decode worker read, ...)",
    ["stat"],
)


def _observe_engine_handoffs(extra: dict[str, float]) -> None:
    for key, value in extra.items():
        if key.startswith("handoffs_") and key.endswith("_total"):
            ENGINE_HANDOFFS.labels(key.removeprefix("handoffs_").removesuffix("_total")).set(value)
        elif key.startswith("nixl_") and key.endswith("_total"):
            NIXL.labels(key.removeprefix("nixl_").removesuffix("_total")).set(value)


def observe_pull(p: PullOutcome) -> None:
    KV_PULL_HINTS.labels("true" if p.blocks else "false").inc()
    KV_PULL_OUTCOMES.labels(p.outcome).inc()


def observe_hold(blocks: int) -> None:
    """A prefill half's blocks held for its decode worker."""
    HANDOFF_HOLDS.inc()
    HANDOFF_HELD_BLOCKS.inc(blocks)


def observe_hold_end(blocks: int, outcome: str, collected_bytes: int) -> None:
    """A hold ended (collected or expired); `collected_bytes` of its blocks went to the decode worker."""
    HANDOFF_HOLDS.dec()
    HANDOFF_HELD_BLOCKS.dec(blocks)
    HANDOFFS.labels(outcome).inc()
    HANDOFF_BYTES.inc(collected_bytes)


class StreamTimer:
    """TTFT and inter-token latency of one stream, from a monotonic clock reading per delta."""

    def __init__(self, start: float) -> None:
        self.start = start
        self.last: float | None = None

    def tokens(self, now: float, n: int) -> None:
        if n <= 0:
            return
        if self.last is None:
            TTFT.observe(now - self.start)
        else:
            ITL.observe((now - self.last) / n)
        self.last = now
