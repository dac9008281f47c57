"""Parsing and validation of OpenAI completion and chat requests (pure): a JSON body in, an `OpenAIRequest`
out, or `InvalidArgument` naming the field (the HTTP `param`).

Which fields are served, which are accepted only with the value that means "off" (`n: 1`, `logprobs:
false`, `response_format: {"type": "text"}`, null ...) and which are refused is `kvmesh.openai.fields`'
table (docs/openai-compatibility.md); any field outside it is refused with InvalidArgument naming it (a typo
or a feature the client relies on is never silently ignored). Chat content is a string or parts of type
`text` (another part type is refused naming `messages[i].content[j].type`). The sampling bounds are
`kvmesh.core.sampling`'s, the same as gRPC's. Text must be valid Unicode (a lone surrogate such as
"\\ud800", which JSON can carry but UTF-8 cannot, is refused); token ids are integers, never booleans.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any

from kvmesh.core.errors import InvalidArgument
from kvmesh.core.generation import SamplingParams
from kvmesh.core.sampling import validate_sampling
from kvmesh.openai.fields import fields_of

SEED_MAX = 2**63 - 1  # int64 in vLLM, uint64 on kvmesh's wire: [0, 2**63) fits both

Message = tuple[str, str]  # (role, content)
PromptInput = tuple[tuple[int, ...] | None, str | None]  # (token ids, text): one of the two is set

STREAM_OPTIONS = frozenset({"include_usage", "continuous_usage_stats"})
_MESSAGE_KEYS = frozenset({"role", "content"})


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
    # a completions batch: one (ids, text) per prompt, each routed on its own prefix; `prompt_ids` /
    # `prompt_text` are the first (the only one without a batch)
    prompts: tuple[PromptInput, ...] = ()
    echo: bool = False  # completions: the prompt's text (and log-probabilities) before the completion
    tools: tuple[dict[str, Any], ...] = ()  # chat: the `tools` as given (function definitions)
    tool_choice: str | dict[str, Any] = "none"  # "none", "auto", "required" or {"type": "function", ...}
    chat_template_kwargs: dict[str, Any] = field(default_factory=dict)
    add_generation_prompt: bool = True
    continue_final_message: bool = False


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
    """InvalidArgument naming the first field the endpoint's table (`kvmesh.openai.fields`) does not serve:
    one outside it, a refused one that is not null, an "off only" one with another value."""
    table = fields_of("chat" if chat else "completions")
    for key, value in body.items():
        f = table.get(key)
        if f is None:
            raise InvalidArgument(key, "unknown or unsupported field (docs/openai-compatibility.md)")
        if f.support == "supported" or value is None:
            continue
        if f.support == "refused":
            raise InvalidArgument(key, f"not supported: {f.why}")
        if not _is_off(value, f.off):
            if key == "logit_bias" and not _is_bias_map(value):
                raise InvalidArgument(key, "must be an object of token id -> bias in [-100, 100]")
            offs = " or ".join(json.dumps(o) for o in (*f.off, None))
            raise InvalidArgument(key, f"not supported ({f.why}): only {offs} is accepted")


def _is_off(value: object, offs: tuple[object, ...]) -> bool:
    """One of `offs` of the same type (True is not 1, 0.0 is not 0)."""
    return any(type(value) is type(off) and value == off for off in offs)


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
    """A chat's `messages` as (role, content); the text parts of a content list are joined."""
    msgs = body.get("messages")
    if not isinstance(msgs, list) or not msgs:
        raise InvalidArgument("messages", "a non-empty list of {role, content} is required")
    out = []
    for i, msg in enumerate(msgs):
        if not isinstance(msg, dict) or not isinstance(msg.get("role"), str):
            raise InvalidArgument(f"messages[{i}]", "needs a string role")
        extra = next((k for k in msg if k not in _MESSAGE_KEYS and msg[k] is not None), None)
        if extra is not None:
            raise InvalidArgument(f"messages[{i}].{extra}", "not supported: a message is {role, content}")
        content = msg.get("content", "")
        if isinstance(content, list):
            content = _text_parts(content, f"messages[{i}].content")
        if not isinstance(content, str):
            raise InvalidArgument(f"messages[{i}].content", "must be a string or a list of text parts")
        out.append((check_text(msg["role"], f"messages[{i}].role"), check_text(content, f"messages[{i}].content")))
    return tuple(out)


def _text_parts(parts: list[Any], where: str) -> str:
    """The text of OpenAI's content parts, all of which must be `{"type": "text", "text": str}`."""
    texts = []
    for j, part in enumerate(parts):
        if not isinstance(part, dict):
            raise InvalidArgument(f"{where}[{j}]", "must be a content part object")
        kind = part.get("type")
        if kind != "text":
            got = json.dumps(kind) if isinstance(kind, str | None) else "a non-string"
            raise InvalidArgument(f"{where}[{j}].type", f'only "text" parts are served (a text model), got {got}')
        if not isinstance(part.get("text"), str):
            raise InvalidArgument(f"{where}[{j}].text", "must be a string")
        texts.append(check_text(part["text"], f"{where}[{j}].text"))
    return "".join(texts)


def parse_stream(body: dict[str, Any]) -> tuple[bool, bool]:
    """(`stream`, `stream_options.include_usage`); options only with a stream (as vLLM), usage at the end only."""
    stream = _bool(body, "stream")
    options = body.get("stream_options")
    if options is None:
        return stream, False
    if not isinstance(options, dict):
        raise InvalidArgument("stream_options", "must be an object")
    if not stream:
        raise InvalidArgument("stream_options", "only with stream: true (as vLLM)")
    for key in options:
        if key not in STREAM_OPTIONS:
            raise InvalidArgument(f"stream_options.{key}", "unknown option")
    if _bool(options, "continuous_usage_stats"):
        raise InvalidArgument("stream_options.continuous_usage_stats", "not supported: usage comes at the end")
    return stream, _bool(options, "include_usage", "stream_options.include_usage")


def parse_sampling(
    body: dict[str, Any], chat: bool, max_tokens_limit: int | None, default_max_tokens: int | None
) -> SamplingParams:
    """The sampling fields, type-checked here and range-checked by `validate_sampling` (gRPC's bounds)."""
    max_key = "max_completion_tokens" if chat and body.get("max_completion_tokens") is not None else "max_tokens"
    _int(body, "max_tokens", None)  # typed even when max_completion_tokens wins
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
    try:
        validate_sampling(sp, max_tokens_limit)
    except InvalidArgument as e:  # the bound of the limit, named as the client named it
        raise (
            InvalidArgument(max_key, e.message.removeprefix("max_tokens: ")) if e.field == "max_tokens" else e
        ) from None
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


def _bool(body: dict[str, Any], key: str, name: str = "") -> bool:
    v = body.get(key)
    if v is not None and not isinstance(v, bool):
        raise InvalidArgument(name or key, "must be a boolean")
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
