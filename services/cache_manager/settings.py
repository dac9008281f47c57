"""Settings of the cache-manager service (flags and KVMESH_* env, see kvmesh.core.config)."""

from __future__ import annotations

from dataclasses import dataclass

from kvmesh.core.config import ServerSettings, setting


@dataclass(frozen=True)
class CacheManagerSettings(ServerSettings):
    """kvmesh cache-manager: the zone's global KV prefix index."""

    block_size: int = setting(32, "tokens per KV block, equal to the workers'")
    model: str = setting("", "served model name, part of the hash salt")
    checkpoint_dir: str = setting("", "file checkpoints here (embedded default when no Redis is given)")
    redis_url: str = setting("", "Redis URL for checkpoints, e.g. redis://127.0.0.1:6379/0")
    redis_prefix: str = setting("kvmesh:cm", "key prefix of this cache-manager's checkpoint in Redis")
    checkpoint_interval_s: float = setting(30.0, "seconds between automatic checkpoints (0 = off)")
    vllm_zmq: tuple[str, ...] = setting(
        (), "stock vLLM KV event publishers to follow: worker_id=PUB_ENDPOINT[;REPLAY_ENDPOINT],..."
    )
    warm_threshold: int = setting(5, "a prefix seen this many times in the window is warmed onto more workers")
    warm_window_s: float = setting(60.0, "sliding window of prefix statistics, seconds")
    warm_max_replicas: int = setting(4, "most workers a hot prefix is warmed onto")
    warm_capacity_blocks: int = setting(100_000, "blocks kept warm by the LFU+LRU policy")
    warm_half_life_s: float = setting(120.0, "half-life of the LFU+LRU score (large = LFU, small = LRU)")
    warm_interval_s: float = setting(10.0, "seconds between dynamic warming rounds (0 = off)")
    warm_templates: str = setting(
        "",
        "YAML/JSON file of prefix templates preloaded onto workers as they register "
        "(a list of {name, token_ids, replicas}; replicas 0 = every worker)",
    )
    warm_lfu_weight: float = setting(
        -1.0, "keep-warm score: w·count + (1−w)·recency for w in [0, 1]; < 0 = LRFU decayed count"
    )
    publish_max_workers: int = setting(4, "distinct worker ids one PublishKvEvents stream may carry")
    publish_burst_blocks: int = setting(
        524_288, "stored blocks one PublishKvEvents stream may send at once (a worker's full dump must fit)"
    )
    publish_blocks_per_s: float = setting(131_072.0, "refill rate of a PublishKvEvents stream's block budget")
    watch_journal_revisions: int = setting(
        4096, "index revisions kept for resumed WatchIndex streams (a resume older than these gets a snapshot)"
    )
    follow_zone: tuple[str, ...] = setting(
        (), "other zones' cache-managers whose indexes this one follows: ZONE=HOST:PORT,... (docs/zones.md)"
    )
    replication_bytes_per_s: float = setting(
        0.0, "byte budget of hot-prefix replication into each followed zone, bytes/s (0 = off; docs/zones.md)"
    )
    replication_interval_s: float = setting(2.0, "seconds between hot-prefix replication rounds")
    replication_threshold: int = setting(
        2, "a prefix seen this many times in the window is replicated (2: a conversation that continued)"
    )
    kvsync_address_map: tuple[str, ...] = setting(
        (), "FROM=TO: another zone's kv-sync address as this zone's workers dial it (a NAT or link proxy)"
    )
    replication_pull_timeout_ms: int = setting(10_000, "deadline of a replica's pull from another zone, milliseconds")
    # The lease spans the ReplicatePrefixes call, the receiving zone's scheduling of the prefill and its
    # pull (the receiving worker keeps a 1 s margin for clock skew): seconds, not the milliseconds of the
    # read. Longer pins the source's slots longer after the read (a lease is not released early).
    replication_lease_ms: int = setting(
        10_000, "lease taken at the source worker on each replicated prefix's blocks and sent with it, milliseconds"
    )
