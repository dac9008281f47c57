"""The router request path's guards and failure budgets (from `RouterSettings`)."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class CoreLimits:
    """Request guards and failure budgets."""

    block_size: int = 32
    max_prompt_tokens: int = 131072
    default_max_tokens: int = 256
    max_tokens_limit: int = 8192
    max_retries: int = 3
    max_migrations: int = 3
    queue_timeout_s: float = 30.0
