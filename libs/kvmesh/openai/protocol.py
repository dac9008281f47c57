"""Parsing and validation of OpenAI completion and chat requests (pure), the entry point of `kvmesh.openai`'s
parser: a JSON body in, an `OpenAIRequest` out, or `InvalidArgument` naming the field (the HTTP `param`).

Which fields are served, which are accepted only with the value that means "off" (`n: 1`, `logprobs:
false`, `response_format: {"type": "text"}`, null ...) and which are refused is `kvmesh.openai.fields`'
table (docs/openai-compatibility.md), enforced here (`check_fields`); any field outside it is refused with
InvalidArgument naming it (a typo or a feature the client relies on is never silently ignored). Each concern
is read by its module:

- `messages`: a chat's messages and chat-template options (content parts of type `text` only);
- `tools`: `tools`, `tool_choice` and a message's past calls (a forced call becomes the sampling's
  structured output);
- `prompts`: a completion's prompt or batch of prompts;
- `sampling_fields` and `structured`: the sampling fields with `kvmesh.core.sampling`'s bounds (the same as
  gRPC's) and the output constraint;
- `extras`: the bodies of vLLM's `/tokenize` and `/detokenize`;
- `values`: one JSON value, typed (text must be valid Unicode; token ids are integers, never booleans).

This module assembles the request (`parse_request`) and re-exports what the services use of the others.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any

from kvmesh.core.errors import InvalidArgument
from kvmesh.core.generation import SamplingParams
from kvmesh.openai.extras import TokenizeRequest, parse_detokenize, parse_tokenize
from kvmesh.openai.fields import fields_of
from kvmesh.openai.messages import Message, parse_messages, parse_template_options
from kvmesh.openai.prompts import PromptInput, parse_prompts
from kvmesh.openai.sampling_fields import parse_sampling
from kvmesh.openai.tools import forced_call_sampling, parse_tool_fields
from kvmesh.openai.values import bool_field, check_keys, check_text, is_off, str_field

__all__ = [
    "Message",
    "OpenAIRequest",
    "TokenizeRequest",
    "check_fields",
    "check_text",
    "parse_detokenize",
    "parse_model",
    "parse_request",
    "parse_stream",
    "parse_tokenize",
    "require_plain_chat",
]

STREAM_OPTIONS = frozenset({"include_usage", "continuous_usage_stats"})


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
    parallel_tool_calls: bool = True  # false: at most one tool call (vLLM's `maxItems: 1` and its filter)


def parse_request(
    body: dict[str, Any], chat: bool, max_tokens_limit: int | None, default_max_tokens: int | None
) -> OpenAIRequest:
    """The whole request; `default_max_tokens` applies when the body gives none (None = the service's)."""
    check_fields(body, chat)
    model = parse_model(body)
    prompts = () if chat else parse_prompts(body)
    ids, text = prompts[0] if prompts else (None, None)
    messages = parse_messages(body) if chat else ()
    stream, include_usage = parse_stream(body)
    tools, tool_choice, parallel = parse_tool_fields(body) if chat else ((), "none", True)
    template_kwargs, add_generation, continue_final = parse_template_options(body) if chat else ({}, True, False)
    return OpenAIRequest(
        chat=chat,
        sampling=forced_call_sampling(
            parse_sampling(body, chat, max_tokens_limit, default_max_tokens), tool_choice, tools, parallel
        ),
        model=model,
        prompt_ids=ids,
        prompt_text=text,
        messages=messages,
        stream=stream,
        include_usage=include_usage,
        user=str_field(body, "session_id") or str_field(body, "user"),
        prompts=prompts,
        echo=False if chat else bool_field(body, "echo"),
        tools=tools,
        tool_choice=tool_choice,
        parallel_tool_calls=parallel,
        chat_template_kwargs=template_kwargs,
        add_generation_prompt=add_generation,
        continue_final_message=continue_final,
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
        if not is_off(value, f.off):
            offs = " or ".join(json.dumps(o) for o in (*f.off, None))
            raise InvalidArgument(key, f"not supported ({f.why}): only {offs} is accepted")


def parse_model(body: dict[str, Any]) -> str:
    """The `model` field ('' when absent)."""
    return str_field(body, "model")


def parse_stream(body: dict[str, Any]) -> tuple[bool, bool]:
    """(`stream`, `stream_options.include_usage`); options only with a stream (as vLLM), usage at the end only."""
    stream = bool_field(body, "stream")
    options = body.get("stream_options")
    if options is None:
        return stream, False
    if not isinstance(options, dict):
        raise InvalidArgument("stream_options", "must be an object")
    if not stream:
        raise InvalidArgument("stream_options", "only with stream: true (as vLLM)")
    check_keys(options, STREAM_OPTIONS, "stream_options", "unknown option")
    if bool_field(options, "continuous_usage_stats"):
        raise InvalidArgument("stream_options.continuous_usage_stats", "not supported: usage comes at the end")
    return stream, bool_field(options, "include_usage", "stream_options.include_usage")


def require_plain_chat(parsed: OpenAIRequest) -> None:
    """InvalidArgument naming the first chat feature a server rendering only `role` + `content` cannot
    honour (a worker's own HTTP API: tools and template options are the router's)."""
    why = "served by the router (which renders the model's chat template); this endpoint renders plain chats"
    if parsed.tools:
        raise InvalidArgument("tools", why)
    if parsed.chat_template_kwargs:
        raise InvalidArgument("chat_template_kwargs", why)
    if not parsed.add_generation_prompt or parsed.continue_final_message:
        raise InvalidArgument(
            "add_generation_prompt" if not parsed.add_generation_prompt else "continue_final_message", why
        )
    for i, m in enumerate(parsed.messages):
        for key in ("name", "tool_calls", "tool_call_id"):
            if getattr(m, key):
                raise InvalidArgument(f"messages[{i}].{key}", why)
