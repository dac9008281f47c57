"""The router request path's guards and failure budgets (from `RouterSettings`), and the input checks made
before any work: text sizes (before tokenising) and token ids against the model's vocabulary."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from kvmesh.core.errors import InvalidArgument
from kvmesh.openai.protocol import Message

SIM_VOCAB_SIZE = 128256  # the simulated engine's vocabulary (`kvmesh.engine.sim.core.SimConfig.vocab_size`)


@dataclass
class CoreLimits:
    """Request guards and failure budgets. `max_prompt_chars`: a prompt text longer than this cannot be
    within `max_prompt_tokens` (0 = unchecked); `vocab_size`: token ids must be below it (0 = unchecked)."""

    block_size: int = 32
    max_prompt_tokens: int = 131072
    default_max_tokens: int = 256
    max_tokens_limit: int = 8192
    max_retries: int = 3
    max_migrations: int = 3
    queue_timeout_s: float = 30.0
    max_prompt_chars: int = 0
    max_chat_messages: int = 1024
    vocab_size: int = SIM_VOCAB_SIZE


def check_token_ids(ids: Sequence[int], vocab_size: int, field: str) -> None:
    """InvalidArgument(field) unless every id is in [0, vocab_size) (vocab_size 0: only >= 0). Lists (the
    parsers' Python ints, of any size) go through min/max in C; anything else (a protobuf repeated field, an
    array) as a numpy view of its buffer: 50x faster than iterating a repeated field's ints (200 µs per 1K
    ids). A loop only names the bad one."""
    if not len(ids):
        return
    if isinstance(ids, list | tuple):
        low, high = min(ids), max(ids)
    else:
        arr = np.asarray(ids)
        low, high = int(arr.min()), int(arr.max())
    if low >= 0 and (not vocab_size or high < vocab_size):
        return
    i, t = next((i, t) for i, t in enumerate(ids) if t < 0 or (vocab_size and t >= vocab_size))
    bound = f"[0, {vocab_size})" if vocab_size else "non-negative"
    raise InvalidArgument(field, f"token ids must be in {bound}: {field}[{i}] is {t}")


def check_text_size(text: str, max_chars: int, field: str) -> None:
    """InvalidArgument(field) when `text` is longer than `max_chars` (0 = unchecked): refused before it is
    tokenised, so an oversize prompt costs neither the time nor the memory of tokenising it."""
    check_text_size_total(len(text), max_chars, field)


def check_chat_size(messages: Sequence[Message], max_messages: int, max_chars: int, extra_chars: int = 0) -> None:
    """Message count and the total text length of a chat (+ `extra_chars`: its tools and template options),
    before it is rendered and tokenised."""
    if max_messages and len(messages) > max_messages:
        raise InvalidArgument("messages", f"{len(messages)} messages > limit {max_messages}")
    check_text_size_total(sum(m.chars for m in messages) + extra_chars, max_chars, "messages")


def check_text_size_total(n_chars: int, max_chars: int, field: str) -> None:
    """`check_text_size` for a length already summed."""
    if max_chars and n_chars > max_chars:
        raise InvalidArgument(field, f"{n_chars} characters > limit {max_chars} (the prompt token limit)")
