"""A completions request's `prompt` (pure): text, token ids, or a batch of either, as vLLM 0.32 reads it, or
`InvalidArgument` naming the field (`prompt`, `prompt[i]` for a batch's bad one). Token ids are integers,
never booleans; their vocabulary bound is the router's (`services/router/request.py`).
"""

from __future__ import annotations

from typing import Any

from kvmesh.core.errors import InvalidArgument
from kvmesh.openai.fields import MAX_PROMPTS
from kvmesh.openai.values import check_text, is_int

PromptInput = tuple[tuple[int, ...] | None, str | None]  # (token ids, text): one of the two is set


def parse_prompts(body: dict[str, Any]) -> tuple[PromptInput, ...]:
    """A completion's `prompt` as one (token ids, None) or (None, text) per prompt: a string, a list of token
    ids, or a non-empty list of strings or of token-id lists (a batch of at most MAX_PROMPTS, as vLLM)."""
    p = body.get("prompt")
    if isinstance(p, list) and p and all(isinstance(x, str | list) for x in p):
        if len(p) > MAX_PROMPTS:
            raise InvalidArgument("prompt", f"a batch of at most {MAX_PROMPTS} prompt(s) is served, got {len(p)}")
        return tuple(_one_prompt(x, f"prompt[{i}]") for i, x in enumerate(p))
    return (_one_prompt(p, "prompt"),)


def _one_prompt(p: object, name: str) -> PromptInput:
    if isinstance(p, str) and p:
        return None, check_text(p, name)
    if isinstance(p, list) and p and all(is_int(t) and t >= 0 for t in p):
        return tuple(p), None
    raise InvalidArgument(name, "a non-empty string, a list of token ids, or a list of either")
