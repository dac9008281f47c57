"""Parsing and validation of OpenAI completion and chat requests (pure): a JSON body in, an `OpenAIRequest`
out, or `InvalidArgument` naming the field (the HTTP `param`).

Accepted (what the router's and the worker's HTTP layers served): `model`; `prompt` as text, token ids or a
one-element list of either (completions); `messages` of `{role, content}` with text or text parts (chat);
`max_tokens` (chat also `max_completion_tokens`), `min_tokens`, `temperature`, `top_p`, `top_k`, `seed`,
`stop` (string or list), `stop_token_ids`, `ignore_eos`, `presence_penalty`, `frequency_penalty`,
`repetition_penalty`, `stream`, `stream_options.include_usage`, `user` / `session_id`. The sampling bounds
are `kvmesh.engine.validation`'s, the same as gRPC's.

Every other field is refused with InvalidArgument naming it: OpenAI fields kvmesh does not implement (`n`,
`best_of`, `logprobs`, `top_logprobs`, `echo`, `suffix`, `logit_bias`) are accepted only with the value that
means "off" (`n: 1`, `echo: false`, `logit_bias: {}`, null ...), and unknown fields always (a typo or a
feature the client relies on is never silently ignored). Text must be valid Unicode (a lone surrogate such
as "\\ud800", which JSON can carry but UTF-8 cannot, is refused); token ids are integers, never booleans.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any

from kvmesh.engine.base import SamplingParams
from kvmesh.engine.validation import validate_sampling
from kvmesh.errors import InvalidArgument

SEED_MAX = 2**63 - 1  # int64 in vLLM, uint64 on kvmesh's wire: [0, 2**63) fits both

Message = tuple[str, str]  # (role, content)

# fields served by both endpoints
_COMMON = frozenset(
    {
        "model", "max_tokens", "min_tokens", "temperature", "top_p", "top_k", "seed", "stop", "stop_token_ids",
        "ignore_eos", "presence_penalty", "frequency_penalty", "repetition_penalty", "stream", "stream_options",
        "user", "session_id",
    }
)  # fmt: skip
# OpenAI fields kvmesh does not implement -> the values that mean "off" (accepted; anything else is refused)
_OFF_ONLY: dict[str, tuple[object, ...]] = {
    "n": (1,),
    "best_of": (1,),
    "logprobs": (False, 0),
    "top_logprobs": (0,),
    "echo": (False,),
    "suffix": ("",),
    "logit_bias": ({},),
}
_COMPLETION_FIELDS = _COMMON | {"prompt", "n", "best_of", "logprobs", "echo", "suffix", "logit_bias"}
_CHAT_FIELDS = _COMMON | {"messages", "max_completion_tokens", "n", "logprobs", "top_logprobs", "logit_bias"}


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
    check_fields(body, chat)
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


def check_fields(body: dict[str, Any], chat: bool) -> None:
    """InvalidArgument naming the first field the endpoint does not know, or an unimplemented one that is
    not "off" (see the module docstring)."""
    known = _CHAT_FIELDS if chat else _COMPLETION_FIELDS
    for key, value in body.items():
        if key not in known:
            raise InvalidArgument(key, "unknown or unsupported field")
        offs = _OFF_ONLY.get(key)
        if offs is not None and not _is_off(value, offs):
            if key == "logit_bias" and not _is_bias_map(value):
                raise InvalidArgument(key, "must be an object of token id -> bias in [-100, 100]")
            raise InvalidArgument(key, f"not supported: only {json.dumps(offs[0])} (or null) is accepted")


def _is_off(value: object, offs: tuple[object, ...]) -> bool:
    """None, or one of `offs` of the same type (True is not 1, 0.0 is not 0)."""
    return value is None or any(type(value) is type(off) and value == off for off in offs)


def _is_bias_map(value: object) -> bool:
    """OpenAI's `logit_bias` shape: {"<token id>": number in [-100, 100]}."""
    return isinstance(value, dict) and all(
        isinstance(k, str) and k.isdigit() and isinstance(v, int | float) and not isinstance(v, bool)
        and -100 <= v <= 100
        for k, v in value.items()
    )  # fmt: skip


def check_text(value: str, field: str) -> str:
    """`value`, or InvalidArgument when it cannot be UTF-8 encoded (a lone surrogate from a JSON escape)."""
    try:
        value.encode("utf-8")
    except UnicodeEncodeError as e:
        raise InvalidArgument(field, f"invalid Unicode at character {e.start} (a lone surrogate?)") from None
    return value


def parse_model(body: dict[str, Any]) -> str:
    """The `model` field ('' when absent)."""
    return _opt_str(body, "model")


def parse_prompt(body: dict[str, Any]) -> tuple[tuple[int, ...] | None, str | None]:
    """(token ids, None) or (None, text) of a completion's `prompt`."""
    p = body.get("prompt")
    if isinstance(p, list) and len(p) == 1 and isinstance(p[0], str | list):
        p = p[0]
    if isinstance(p, str) and p:
        return None, check_text(p, "prompt")
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
            texts = [p.get("text", "") for p in content if isinstance(p, dict)]
            content = "".join(texts) if all(isinstance(t, str) for t in texts) else None
        if not isinstance(content, str):
            raise InvalidArgument(f"messages[{i}].content", "must be a string or a list of text parts")
        out.append((check_text(msg["role"], f"messages[{i}].role"), check_text(content, f"messages[{i}].content")))
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
        repetition_penalty=_float(body, "repetition_penalty", 1.0),
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
    return check_text(v or "", key)


def _stop(body: dict[str, Any]) -> tuple[str, ...]:
    stop = body.get("stop")
    if stop is None:
        return ()
    if isinstance(stop, str):
        return (check_text(stop, "stop"),)
    if isinstance(stop, list) and all(isinstance(s, str) for s in stop):
        return tuple(check_text(s, "stop") for s in stop)
    raise InvalidArgument("stop", "must be a string or a list of strings")


def _token_ids(body: dict[str, Any], key: str) -> tuple[int, ...]:
    v = body.get(key)
    if v is None:
        return ()
    if not isinstance(v, list) or not all(_is_int(t) for t in v):
        raise InvalidArgument(key, "must be a list of token ids")
    return tuple(v)
