"""Settings of the router service (flags and KVMESH_* env, see kvmesh.config)."""

from __future__ import annotations

from dataclasses import dataclass

from kvmesh.config import ServerSettings, setting


@dataclass(frozen=True)
class RouterSettings(ServerSettings):
    """kvmesh router: the client-facing API and the routing decision."""

    workers: list[str] = setting([], "static worker gRPC addresses (comma-separated)")
    cache_manager: str = setting("", "cache-manager gRPC address (index watch, FindMatches)")
    failover: str = setting("", "failover gRPC address to follow endpoint sets from")
    model: str = setting("", "model folder for the tokenizer; default: the tiny local test model")
    model_name: str = setting("", "served model name reported by /v1/models (default: folder name)")
    block_size: int = setting(32, "tokens per KV block, equal to the workers'")
    policy_file: str = setting("", "routing profile YAML (default: the built-in kvmesh profile)")
    api_keys_file: str = setting("", "file with one API key per line (empty = no authentication)")
    long_prompt_tokens: int = setting(2048, "prompts longer than this go to the long queue")
    max_migrations: int = setting(3, "times one request may move to another worker")
