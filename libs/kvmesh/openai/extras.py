"""The bodies of vLLM's `/tokenize` and `/detokenize` (pure; vLLM 0.32's TokenizeCompletionRequest |
TokenizeChatRequest and DetokenizeRequest), or `InvalidArgument` naming the field. The router answers with
the tokens it routes with, so the options that would change them are taken only at the values that do not
(null always); the others are refused naming them.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

from kvmesh.core.errors import InvalidArgument
from kvmesh.openai.messages import Message, parse_messages
from kvmesh.openai.values import check_keys, check_text, is_int, is_off, str_field

TOKEN_ID_MAX = 2**63 - 1  # the largest id a JSON body may name (the vocabulary's bound is the router's)
_TOKENIZE_KEYS = frozenset({"model", "prompt", "messages"})
_TOKENIZE_AS_ROUTED: dict[str, object] = {
    "add_special_tokens": False,  # the router's encoding adds none (a chat template writes its own)
    "return_token_strs": False,  # the router's tokenizer maps ids to text, not to vocabulary strings
    "add_generation_prompt": True,
    "continue_final_message": False,
}
_TOKENIZE_CHAT_ONLY = frozenset({"add_generation_prompt", "continue_final_message"})
_TOKENIZE_CHAT_REFUSED = frozenset({"chat_template", "chat_template_kwargs", "tools", "media_io_kwargs",
                                    "mm_processor_kwargs"})  # fmt: skip


@dataclass(frozen=True, slots=True)
class TokenizeRequest:
    """`/tokenize`: a prompt text (vLLM's completion form) or chat messages (its chat form)."""

    model: str
    prompt: str | None = None
    messages: tuple[Message, ...] = ()


def parse_tokenize(body: dict[str, Any]) -> TokenizeRequest:
    """A `/tokenize` body; InvalidArgument naming an unknown field, an option at a value the router's own
    tokenisation does not use, or a bad prompt / message."""
    chat = body.get("messages") is not None
    for key, value in body.items():
        if key in _TOKENIZE_KEYS or value is None:
            continue
        off = _TOKENIZE_AS_ROUTED.get(key) if chat or key not in _TOKENIZE_CHAT_ONLY else None
        if off is None:
            why = "not supported by the router's chat rendering" if chat and key in _TOKENIZE_CHAT_REFUSED else ""
            raise InvalidArgument(key, why or "unknown or unsupported field")
        if not is_off(value, (off,)):
            raise InvalidArgument(key, f"only {json.dumps(off)} or null: the router answers with the tokens it routes")
    model = str_field(body, "model")
    if chat:
        if body.get("prompt") is not None:
            raise InvalidArgument("prompt", "either prompt or messages, not both")
        return TokenizeRequest(model, messages=parse_messages(body))
    prompt = body.get("prompt")
    if not isinstance(prompt, str):
        raise InvalidArgument("prompt", "a string (or messages) is required")
    return TokenizeRequest(model, prompt=check_text(prompt, "prompt"))


def parse_detokenize(body: dict[str, Any]) -> tuple[str, tuple[int, ...]]:
    """A `/detokenize` body: (model, token ids)."""
    check_keys(body, ("model", "tokens"), "", "unknown or unsupported field")
    tokens = body.get("tokens")
    if not isinstance(tokens, list) or not all(is_int(t) and 0 <= t <= TOKEN_ID_MAX for t in tokens):
        raise InvalidArgument("tokens", "a list of token ids (integers >= 0) is required")
    return str_field(body, "model"), tuple(tokens)
