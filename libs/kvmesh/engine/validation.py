"""Validation of sampling parameters and prompt lengths, shared by every engine (raises InvalidArgument)."""

from __future__ import annotations

import math

from kvmesh.engine.base import SamplingParams
from kvmesh.errors import InvalidArgument


def validate_sampling(p: SamplingParams, max_tokens_limit: int) -> None:
    """Raise `InvalidArgument(field, ...)` for the first out-of-range field (vLLM's own ranges)."""
    if p.max_tokens is not None and not 1 <= p.max_tokens <= max_tokens_limit:
        raise InvalidArgument("max_tokens", f"must be in [1, {max_tokens_limit}], got {p.max_tokens}")
    if p.min_tokens < 0 or (p.max_tokens is not None and p.min_tokens > p.max_tokens):
        raise InvalidArgument("min_tokens", f"must be in [0, max_tokens], got {p.min_tokens}")
    if not math.isfinite(p.temperature) or p.temperature < 0:
        raise InvalidArgument("temperature", f"must be a finite number >= 0, got {p.temperature}")
    if not math.isfinite(p.top_p) or not 0 < p.top_p <= 1:
        raise InvalidArgument("top_p", f"must be in (0, 1], got {p.top_p}")
    if p.top_k < -1:
        raise InvalidArgument("top_k", f"must be -1, 0 (disabled) or positive, got {p.top_k}")
    for name, value in (("presence_penalty", p.presence_penalty), ("frequency_penalty", p.frequency_penalty)):
        if not math.isfinite(value) or not -2 <= value <= 2:
            raise InvalidArgument(name, f"must be in [-2, 2], got {value}")
    if not math.isfinite(p.repetition_penalty) or p.repetition_penalty <= 0:
        raise InvalidArgument("repetition_penalty", f"must be > 0, got {p.repetition_penalty}")
    if any(t < 0 for t in p.stop_token_ids):
        raise InvalidArgument("stop_token_ids", "token ids must be >= 0")
    if any(s == "" for s in p.stop):
        raise InvalidArgument("stop", "stop strings must be non-empty")


def resolve_max_tokens(p: SamplingParams, prompt_len: int, max_model_len: int, max_tokens_limit: int) -> int:
    """Completion budget: min(max_tokens or limit, max_model_len - prompt_len); raise if the prompt does
    not leave room for one token."""
    if prompt_len == 0:
        raise InvalidArgument("prompt", "prompt is empty")
    room = max_model_len - prompt_len
    if room < 1:
        raise InvalidArgument(
            "prompt", f"prompt has {prompt_len} tokens; the model's context is {max_model_len} tokens"
        )
    wanted = p.max_tokens if p.max_tokens is not None else max_tokens_limit
    if p.max_tokens is not None and wanted > room:
        raise InvalidArgument(
            "max_tokens",
            f"prompt ({prompt_len}) + max_tokens ({wanted}) exceeds the context of {max_model_len} tokens",
        )
    return min(wanted, room, max_tokens_limit)
