"""Parsing and validation of OpenAI completion and chat requests (pure): a JSON body in, an `OpenAIRequest`
out, or `InvalidArgument` naming the field (the HTTP `param`).

Accepted (what the router's and the worker's HTTP layers served): `model`; `prompt` as text, token ids or a
one-element list of either (completions); `messages` of `{role, content}` with text or text parts (chat);
`max_tokens` (chat also `max_completion_tokens`), `min_tokens`, `temperature`, `top_p`, `top_k`, `seed`,
`stop` (string or list), `stop_token_ids`, `ignore_eos`, `presence_penalty`, `frequency_penalty`, `n` (1
only), `stream`, `stream_options.include_usage`, `user` / `session_id`. The sampling bounds are
`kvmesh.engine.validation`'s, the same as gRPC's.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from kvmesh.engine.base import SamplingParams
from kvmesh.engine.validation import validate_sampling
from kvmesh.errors import InvalidArgument

SEED_MAX = 2**63 - 1  # int64 in vLLM, uint64 on kvmesh's wire: [0, 2**63) fits both

Message = tuple[str, str]  # (role, content)


@dataclass(frozen=True, slots=True)
class OpenAIRequest:
    """A parsed completion (`prompt_ids` or `prompt_text`) or chat (`messages`) request."""

    chat: bool
    sampling: SamplingParams
    model: str = ""
    prompt_ids: tuple[int, ...] | None = None
    prompt_text: str | None = None
    messages: tuple[Message, ...] = field(default=())
    stream: bool = False
    include_usage: bool = False
    user: str = ""


def parse_request(
    body: dict[str, Any], chat: bool, max_tokens_limit: int | None, default_max_tokens: int | None
) -> OpenAIRequest:
    """The whole request; `default_max_tokens` applies when the body gives none (None = the service's)."""
    model = parse_model(body)
    ids, text = (None, None) if chat else parse_prompt(body)
    messages = parse_messages(body) if chat else ()
    stream, include_usage = parse_stream(body)
    return OpenAIRequest(
        chat=chat,
        sampling=parse_sampling(body, chat, max_tokens_limit, default_max_tokens),
        model=model,
        prompt_ids=ids,
        prompt_text=text,
        messages=messages,
        stream=stream,
        include_usage=include_usage,
        user=_opt_str(body, "session_id") or _opt_str(body, "user"),
    )


def parse_model(body: dict[str, Any]) -> str:
    """The `model` field ('' when absent)."""
    return _opt_str(body, "model")


def parse_prompt(body: dict[str, Any]) -> tuple[tuple[int, ...] | None, str | None]:
    """(token ids, None) or (None, text) of a completion's `prompt`."""
    p = body.get("prompt")
    if isinstance(p, list) and len(p) == 1 and isinstance(p[0], str | list):
        p = p[0]
    if isinstance(p, str) and p:
        return None, p
    if isinstance(p, list) and p and all(_is_int(t) and t >= 0 for t in p):
        return tuple(p), None
    raise InvalidArgument("prompt", "a non-empty string, a list of token ids, or a one-element list of either")


def parse_messages(body: dict[str, Any]) -> tuple[Message, ...]:
    """A chat's `messages` as (role, content); text parts of a content list are joined."""
    msgs = body.get("messages")
    if not isinstance(msgs, list) or not msgs:
        raise InvalidArgument("messages", "a non-empty list of {role, content} is required")
    out = []
    for i, msg in enumerate(msgs):
        if not isinstance(msg, dict) or not isinstance(msg.get("role"), str):
            raise InvalidArgument(f"messages[{i}]", "needs a string role")
        content = msg.get("content", "")
        if isinstance(content, list):  # content parts: keep the text ones
            content = "".join(p.get("text", "") for p in content if isinstance(p, dict))
        if not isinstance(content, str):
            raise InvalidArgument(f"messages[{i}].content", "must be a string or a list of text parts")
        out.append((msg["role"], content))
    return tuple(out)


def parse_stream(body: dict[str, Any]) -> tuple[bool, bool]:
    """(`stream`, `stream_options.include_usage`)."""
    options = body.get("stream_options") or {}
    if not isinstance(options, dict):
        raise InvalidArgument("stream_options", "must be an object")
    return bool(body.get("stream")), bool(options.get("include_usage"))


def parse_sampling(
    body: dict[str, Any], chat: bool, max_tokens_limit: int | None, default_max_tokens: int | None
) -> SamplingParams:
    """The sampling fields, type-checked here and range-checked by `validate_sampling` (gRPC's bounds)."""
    if _int(body, "n", 1) != 1:
        raise InvalidArgument("n", "only n=1 is supported")
    max_key = "max_completion_tokens" if chat and body.get("max_completion_tokens") is not None else "max_tokens"
    seed = _int(body, "seed", None)
    if seed is not None and not 0 <= seed <= SEED_MAX:
        raise InvalidArgument("seed", f"must be in [0, {SEED_MAX}], got {seed}")
    sp = SamplingParams(
        max_tokens=_int(body, max_key, default_max_tokens),
        min_tokens=_int(body, "min_tokens", 0),
        temperature=_float(body, "temperature", 1.0),
        top_p=_float(body, "top_p", 1.0),
        top_k=_int(body, "top_k", 0),
        seed=seed,
        stop=_stop(body),
        stop_token_ids=_token_ids(body, "stop_token_ids"),
        ignore_eos=_bool(body, "ignore_eos"),
        presence_penalty=_float(body, "presence_penalty", 0.0),
        frequency_penalty=_float(body, "frequency_penalty", 0.0),
    )
    validate_sampling(sp, max_tokens_limit)
    return sp


def _is_int(v: object) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _int(body: dict[str, Any], key: str, default: int | None) -> Any:
    v = body.get(key)
    if v is None:
        return default
    if not _is_int(v):
        raise InvalidArgument(key, "must be an integer")
    return v


def _float(body: dict[str, Any], key: str, default: float) -> float:
    v = body.get(key)
    if v is None:
        return default
    if not isinstance(v, int | float) or isinstance(v, bool):
        raise InvalidArgument(key, "must be a number")
    return float(v)


def _bool(body: dict[str, Any], key: str) -> bool:
    v = body.get(key)
    if v is not None and not isinstance(v, bool):
        raise InvalidArgument(key, "must be a boolean")
    return bool(v)


def _opt_str(body: dict[str, Any], key: str) -> str:
    v = body.get(key)
    if v is not None and not isinstance(v, str):
        raise InvalidArgument(key, "must be a string")
    return v or ""


def _stop(body: dict[str, Any]) -> tuple[str, ...]:
    stop = body.get("stop")
    if stop is None:
        return ()
    if isinstance(stop, str):
        return (stop,)
    if isinstance(stop, list) and all(isinstance(s, str) for s in stop):
        return tuple(stop)
    raise InvalidArgument("stop", "must be a string or a list of strings")


def _token_ids(body: dict[str, Any], key: str) -> tuple[int, ...]:
    v = body.get(key)
    if v is None:
        return ()
    if not isinstance(v, list) or not all(_is_int(t) for t in v):
        raise InvalidArgument(key, "must be a list of token ids")
    return tuple(v)
