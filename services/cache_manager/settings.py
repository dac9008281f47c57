"""Settings of the cache-manager service (flags and KVMESH_* env, see kvmesh.config)."""

from __future__ import annotations

from dataclasses import dataclass

from kvmesh.config import ServerSettings, setting


@dataclass(frozen=True)
class CacheManagerSettings(ServerSettings):
    """kvmesh cache-manager: the zone's global KV prefix index."""

    block_size: int = setting(32, "tokens per KV block, equal to the workers'")
    model: str = setting("", "served model name, part of the hash salt")
    checkpoint_dir: str = setting("", "file checkpoints here (embedded default when no Redis is given)")
    redis_url: str = setting("", "Redis URL for checkpoints, e.g. redis://127.0.0.1:6379/0")
    checkpoint_interval_s: float = setting(30.0, "seconds between automatic checkpoints (0 = off)")
    vllm_zmq: list[str] = setting([], "stock vLLM KV event publishers to follow: worker_id=tcp://host:port,...")
