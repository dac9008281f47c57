"""Prometheus metrics of the cache-manager (`kvmesh_cache_*`)."""

from __future__ import annotations

from prometheus_client import Counter, Gauge, Histogram

from kvmesh.core.errors import ResourceExhausted
from kvmesh.telemetry.metrics import LATENCY_BUCKETS

INDEX_BLOCKS = Gauge("kvmesh_cache_index_blocks", "Distinct blocks in the prefix index")
INDEX_PAIRS = Gauge("kvmesh_cache_index_pairs", "(worker, block) pairs in the prefix index")
INDEX_BYTES = Gauge("kvmesh_cache_index_bytes", "Bytes of the prefix index's arrays")
WORKERS = Gauge("kvmesh_cache_workers", "Workers known to the index")
BATCHES = Counter("kvmesh_cache_event_batches_total", "KV event batches received", ["source"])
EVENTS = Counter("kvmesh_cache_events_total", "KV events applied (rate() = events/s)")
GAPS = Counter("kvmesh_cache_sequence_gaps_total", "Sequence gaps detected")
RESTARTS = Counter("kvmesh_cache_worker_restarts_total", "New worker instances seen")
RESYNCS = Counter("kvmesh_cache_resyncs_total", "Resyncs requested", ["kind"])
QUERY_LATENCY = Histogram(
    "kvmesh_cache_query_latency_seconds",
    "FindMatches latency inside the index",
    buckets=(0.00001, 0.00005, 0.0001, 0.00025, *LATENCY_BUCKETS),
)
HIT_RATIO = Gauge(
    "kvmesh_cache_hit_ratio", "Σ best matched blocks / Σ queried blocks since start (FindMatches and routed reports)"
)
ROUTED_PREFIXES = Counter(
    "kvmesh_cache_routed_prefixes_total", "Prompts routers reported routing from their index replicas, counted"
)
MISS_RATIO = Gauge("kvmesh_cache_miss_ratio", "1 − kvmesh_cache_hit_ratio")
QUERIED_BLOCKS = Counter(
    "kvmesh_cache_queried_blocks_total", "Blocks of the prompts queried or routed (FindMatches and routed reports)"
)
HIT_BLOCKS = Counter(
    "kvmesh_cache_hit_blocks_total",
    "Of those, the leading blocks the best-matching worker held (the hit ratio's numerator)",
)
WARMING = Counter("kvmesh_cache_warming_actions_total", "Prefill-only warming requests issued", ["reason"])
WARMING_COOLED = Counter("kvmesh_cache_warming_cooled_total", "Prefixes the LFU+LRU policy stopped keeping warm")
CHECKPOINTS = Counter("kvmesh_cache_checkpoints_total", "Checkpoints written")
CHECKPOINT_FAILURES = Counter(
    "kvmesh_cache_checkpoint_failures_total",
    "Checkpoint-store writes that failed (snapshots and log appends), by reason: full or unavailable",
    ["reason"],
)
CHECKPOINT_SECONDS = Histogram("kvmesh_cache_checkpoint_seconds", "Checkpoint duration", buckets=LATENCY_BUCKETS)
WATCHERS = Gauge("kvmesh_cache_watchers", "Index watch streams open")
WATCH_STREAMS = Counter(
    "kvmesh_cache_watch_streams_total", "Index watch streams started, by how: snapshot or resumed", ["start"]
)
WATCH_DELTAS = Counter(
    "kvmesh_cache_watch_deltas_sent_total", "Index deltas sent to watchers, by part: snapshot, resumed, live", ["part"]
)
ZONE_LAG = Histogram(
    "kvmesh_cache_zone_follow_lag_seconds",
    "Lag of a followed zone's index: apply time here - ingest time there (wall clocks)",
    ["zone"],
    buckets=(0.00025, 0.0005, 0.001, 0.002, 0.003, 0.005, 0.0075, 0.01, 0.015, 0.025, 0.05, 0.1, *LATENCY_BUCKETS[8:]),
)
ZONE_STREAMS = Counter(
    "kvmesh_cache_zone_follow_streams_total",
    "Index streams of a followed zone, by start: snapshot or resumed",
    ["zone", "start"],
)
ZONE_CONNECTED = Gauge("kvmesh_cache_zone_follow_connected", "1 while a followed zone's index stream is live", ["zone"])
ZONE_REVISION = Gauge("kvmesh_cache_zone_follow_revision", "Last revision of a followed zone's index applied", ["zone"])
ZONE_BLOCKS = Gauge("kvmesh_cache_zone_index_blocks", "Distinct blocks of a followed zone's index copy", ["zone"])
REPLICATION_BYTES = Counter(
    "kvmesh_cache_replication_bytes_total", "KV bytes copied into another zone, verified copies only", ["zone"]
)
REPLICATED_PREFIXES = Gauge("kvmesh_cache_replicated_prefixes", "Hot prefixes held in another zone", ["zone"])
REPLICATION_PENDING = Gauge(
    "kvmesh_cache_replication_pending",
    "1 while hot prefixes are still to be replicated into the zone (or it is not followed live)",
    ["zone"],
)
REPLICATED_BLOCKS = Gauge("kvmesh_cache_replicated_blocks", "Blocks of the hot prefixes held in another zone", ["zone"])
REPLICATION_FAILURES = Counter(
    "kvmesh_cache_replication_failures_total",
    "Prefix replications that failed or were not verified",
    ["zone", "reason"],
)
REPLICATION_LEASES = Counter(
    "kvmesh_cache_replication_leases_total",
    "Leases taken at a source worker for the prefixes replicated out, by outcome: taken (sent with the"
    " prefix), failed (the lease call), unheld (not every block held), underived (identities not derivable"
    " here: the receiving worker leases itself)",
    ["outcome"],
)
REPLICATION_SECONDS = Histogram(
    "kvmesh_cache_replication_seconds",
    "One ReplicatePrefixes call into another zone (its workers' pulls included)",
    ["zone"],
    buckets=LATENCY_BUCKETS,
)
REPLICAS_RECEIVED = Counter(
    "kvmesh_cache_replicas_received_total",
    "Prefixes another zone replicated into this one, by outcome",
    ["source_zone", "outcome"],
)


def store_failure(e: BaseException) -> None:
    """Counts a failed checkpoint-store write (`kvmesh.store.base`: a full store is ResourceExhausted)."""
    CHECKPOINT_FAILURES.labels("full" if isinstance(e, ResourceExhausted) else "unavailable").inc()
