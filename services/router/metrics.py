"""Router metrics (Prometheus). Latencies in seconds; names `kvmesh_router_*` plus the two issue-named counters."""

from __future__ import annotations

from collections.abc import Iterator

from prometheus_client import REGISTRY, Counter, Gauge, Histogram
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric

from kvmesh.engine.token_cache import TokenCacheStats
from kvmesh.routing import Admission

_LAT = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2, 5, 10, 30, 60, 120)
_ITL = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5)
_DEC = (0.000005, 0.00001, 0.000025, 0.00005, 0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.01)

TTFT = Histogram("kvmesh_router_ttft_seconds", "Time to first token seen by the client", buckets=_LAT)
ITL = Histogram("kvmesh_router_itl_seconds", "Inter-token latency (per streamed message)", buckets=_ITL)
E2E = Histogram("kvmesh_router_e2e_seconds", "End-to-end request latency", buckets=_LAT)
DECISION = Histogram("kvmesh_router_decision_seconds", "Routing decision latency", buckets=_DEC)
SELECTIONS = Counter("kvmesh_router_selections_total", "Requests routed, per worker", ["worker"])
ROUTED_PROMPT_TOKENS = Counter("kvmesh_router_prompt_tokens_total", "Prompt tokens of routed requests")
ROUTED_CACHED_TOKENS = Counter(
    "kvmesh_router_cached_tokens_total", "Prompt tokens the chosen worker had cached (index), per routing"
)
RETRIES = Counter("kvmesh_retries_total", "Requests re-sent to another worker before their first token")
MIGRATIONS = Counter("kvmesh_migrations_total", "Requests resumed on another worker mid-stream")
STALLS = Counter("kvmesh_router_stalls_total", "Worker streams cancelled for sending no token within their stall bound")
HEDGES = Counter(
    "kvmesh_router_hedges_total", "Requests whose late first token was hedged to a second worker", ["winner"]
)
PULL_HINTS = Counter(
    "kvmesh_router_kv_pull_hints_total",
    "KV pull hints sent to workers: sent (a new pull) or joined (the same hint again, a pull already running)",
    ["outcome"],
)
PREFIX_BLOCKS = Counter(
    "kvmesh_router_prefix_blocks_total",
    "Prompt blocks of routed requests by how the chosen worker obtains them (gpu, load from its tier, pull)",
    ["source"],
)
PREFIX_REPORTS = Counter(
    "kvmesh_router_prefix_reports_total",
    "Prompts routed from the index replica, reported to the cache-manager: sent, dropped (queue full) or failed",
    ["outcome"],
)
PD_DECISIONS = Counter(
    "kvmesh_pd_decisions_total",
    "Prefill/decode decisions of requests on a fleet with prefill workers: mode aggregated or disaggregated, and"
    " the condition that decided (kvmesh.routing.disagg)",
    ["mode", "reason"],
)
PD_PREFILL_SECONDS = Histogram(
    "kvmesh_handoff_seconds", "Prefill halves: from sending to the prefill worker's handoff", buckets=_LAT
)
PD_HANDOFF_BLOCKS = Counter("kvmesh_handoff_blocks_total", "KV blocks handed from prefill to decode workers")
PD_FALLBACKS = Counter(
    "kvmesh_handoff_fallbacks_total",
    "Disaggregated requests served otherwise: prefill_failed / prefill_timeout / prefill_refused (routed again,"
    " aggregated), no_handoff (the decode worker computes the prompt)",
    ["cause"],
)
REQUESTS = Counter("kvmesh_router_requests_total", "Requests by API and outcome", ["api", "outcome"])


class QueueCollector:
    """`kvmesh_router_queue_length` / `kvmesh_router_queue_running{queue}`, read from the admission queues when
    /metrics is scraped rather than set on every request (four labelled gauge updates per request otherwise)."""

    def __init__(self) -> None:
        self.admission: Admission | None = None

    def collect(self) -> Iterator[Metric]:
        waiting = GaugeMetricFamily("kvmesh_router_queue_length", "Requests waiting for admission", labels=["queue"])
        running = GaugeMetricFamily(
            "kvmesh_router_queue_running", "Requests holding an admission slot", labels=["queue"]
        )
        if self.admission is not None:
            for name, st in self.admission.stats().items():
                waiting.add_metric([name], st["waiting"])
                running.add_metric([name], st["running"])
        yield waiting
        yield running


QUEUES = QueueCollector()  # RouterCore points it at its admission queues
REGISTRY.register(QUEUES)
INDEX_TIER_ONLY = Gauge(
    "kvmesh_router_index_tier_only_blocks", "(worker, block) pairs the index replica knows are only in a host tier"
)
INDEX_LOOKUPS = Counter(
    "kvmesh_router_index_lookups_total",
    "Prefix lookups by what answered: replica (this process's copy), shared (the copy the router processes of "
    "this host share), find_matches (the cache-manager, while the copy is stale) or none (no answer: no overlap)",
    ["source"],
)
WORKER_FRAMES_UNREACHABLE = Counter(
    "kvmesh_router_worker_frames_unreachable_total",
    "Workers whose generate-frames port did not answer (their requests went on the gRPC stream for 30 s)",
)
WORKERS_ROUTABLE = Gauge("kvmesh_router_workers_routable", "Workers healthy, not draining, circuit closed")
GUARDRAIL_MATCHES = Counter(
    "kvmesh_router_guardrail_matches_total",
    "Output guardrail matches, per rule and action (mask: the span masked; stop: the stream ended content_filter)",
    ["rule", "action"],
)
GUARDRAIL_RELOADS = Counter(
    "kvmesh_router_guardrail_reloads_total",
    "Guardrail rule files reloaded after a change: ok (the new rules in force) or error (the previous ones kept)",
    ["outcome"],
)
GUARDRAIL_RULES = Gauge("kvmesh_router_guardrail_rules", "Output guardrail rules in force")


class TokenCacheCollector:
    """`kvmesh_router_tokenize_cache_*`: the tokenisation cache's lookups, evictions, rejections and size, read
    from its counters when /metrics is scraped (nothing on the request path)."""

    def __init__(self) -> None:
        self.stats: TokenCacheStats | None = None

    def collect(self) -> Iterator[Metric]:
        st = self.stats or TokenCacheStats()
        lookups = CounterMetricFamily(
            "kvmesh_router_tokenize_cache_lookups",
            "Prompt texts looked up in the tokenisation cache: hit (tokenised before) or miss",
            labels=["result"],
        )
        lookups.add_metric(["hit"], st.hits)
        lookups.add_metric(["miss"], st.misses)
        yield lookups
        yield CounterMetricFamily(
            "kvmesh_router_tokenize_cache_evictions", "Texts dropped from the tokenisation cache", value=st.evictions
        )
        yield CounterMetricFamily(
            "kvmesh_router_tokenize_cache_rejections",
            "Texts the full tokenisation cache did not take (asked for no more often than the texts they displace)",
            value=st.rejections,
        )
        yield GaugeMetricFamily(
            "kvmesh_router_tokenize_cache_bytes", "Bytes the tokenisation cache holds (texts and ids)", value=st.bytes
        )
        yield GaugeMetricFamily(
            "kvmesh_router_tokenize_cache_entries", "Texts in the tokenisation cache", value=st.entries
        )


TOKEN_CACHE = TokenCacheCollector()  # the router's frontend points it at its cache
REGISTRY.register(TOKEN_CACHE)
