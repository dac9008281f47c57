"""The request assembly's refusals at their edges: a worker's plain-chat endpoint refuses each chat feature it
cannot render naming the field, with one message (the router serves it: it renders the model's chat template);
`stream_options` is refused naming the option and what is wrong with it."""

from __future__ import annotations

import dataclasses
from typing import Any

import pytest

from kvmesh.core.errors import InvalidArgument
from kvmesh.openai.fields import fields_of
from kvmesh.openai.protocol import check_fields, parse_request, parse_stream, require_plain_chat

pytestmark = pytest.mark.unit
USER = [{"role": "user", "content": "hi"}]
WHY = "served by the router (which renders the model's chat template); this endpoint renders plain chats"
NOW = {"type": "function", "function": {"name": "now"}}


@pytest.mark.parametrize(
    ("body", "field"),
    [
        ({"tools": [NOW], "tool_choice": "none"}, "tools"),
        ({"chat_template_kwargs": {"x": 1}}, "chat_template_kwargs"),
        ({"add_generation_prompt": False}, "add_generation_prompt"),
        ({"add_generation_prompt": False, "continue_final_message": True}, "add_generation_prompt"),
        ({"messages": [{"role": "user", "content": "hi", "name": "ann"}]}, "messages[0].name"),
        ({"messages": [*USER, {"role": "tool", "tool_call_id": "c1", "content": "3"}]}, "messages[1].tool_call_id"),
    ],
    ids=["tools", "template-kwargs", "no-generation-prompt", "both", "name", "tool-call-id"],
)
def test_a_plain_chat_server_names_the_field_and_says_who_serves_it(body: dict[str, Any], field: str) -> None:
    with pytest.raises(InvalidArgument) as e:
        require_plain_chat(parse_request({"messages": USER} | body, True, 64, None))
    assert e.value.field == field and e.value.message == f"{field}: {WHY}"


def test_continuing_the_final_message_is_named_when_a_generation_prompt_is_on() -> None:
    """`parse_request` refuses the two together; a request built otherwise still names the field it set."""
    parsed = dataclasses.replace(parse_request({"messages": USER}, True, 64, None), continue_final_message=True)
    with pytest.raises(InvalidArgument) as e:
        require_plain_chat(parsed)
    assert e.value.field == "continue_final_message" and e.value.message == f"continue_final_message: {WHY}"


@pytest.mark.parametrize(
    ("options", "stream", "field", "message"),
    [
        ([1], True, "stream_options", "must be an object"),
        ({}, False, "stream_options", "only with stream: true (as vLLM)"),
        ({"x": 1}, True, "stream_options.x", "unknown option"),
        (
            {"continuous_usage_stats": True},
            True,
            "stream_options.continuous_usage_stats",
            "not supported: usage comes at the end",
        ),
        ({"include_usage": "yes"}, True, "stream_options.include_usage", "must be a boolean"),
    ],
    ids=["not-an-object", "without-stream", "unknown", "continuous-usage", "usage-not-bool"],
)
def test_bad_stream_options_name_the_option(options: object, stream: bool, field: str, message: str) -> None:
    with pytest.raises(InvalidArgument) as e:
        parse_stream({"stream": stream, "stream_options": options})
    assert e.value.field == field and e.value.message == f"{field}: {message}"


def test_stream_options_give_usage_at_the_end_only_when_asked() -> None:
    assert parse_stream({}) == (False, False)
    assert parse_stream({"stream": True, "stream_options": None}) == (True, False)
    assert parse_stream({"stream": True, "stream_options": {}}) == (True, False)
    options = {"include_usage": True, "continuous_usage_stats": False}
    assert parse_stream({"stream": True, "stream_options": options}) == (True, True)


def test_a_field_outside_the_table_is_named_as_unknown() -> None:
    with pytest.raises(InvalidArgument) as e:
        check_fields({"model": "m", "zzz": 1}, chat=True)
    assert (
        e.value.field == "zzz" and e.value.message == "zzz: unknown or unsupported field (docs/openai-compatibility.md)"
    )
    with pytest.raises(InvalidArgument) as e:
        check_fields({"echo": True}, chat=True)  # a completions field on a chat
    assert e.value.field == "echo"


def test_a_refused_field_is_named_with_why_unless_null() -> None:
    why = fields_of("chat")["audio"].why
    with pytest.raises(InvalidArgument) as e:
        check_fields({"audio": {"voice": "x"}}, chat=True)
    assert e.value.field == "audio" and e.value.message == f"audio: not supported: {why}"
    check_fields({"audio": None}, chat=True)


def test_an_off_only_field_lists_the_values_it_accepts() -> None:
    why = fields_of("chat")["service_tier"].why
    with pytest.raises(InvalidArgument) as e:
        check_fields({"service_tier": "flex"}, chat=True)
    assert e.value.field == "service_tier"
    assert e.value.message == f'service_tier: not supported ({why}): only "auto" or "default" or null is accepted'
    check_fields({"service_tier": "auto", "store": False, "no_stop_trim": None}, chat=True)


def test_a_completion_carries_the_chat_only_fields_at_their_off_values() -> None:
    parsed = parse_request({"prompt": "x", "echo": True}, False, 64, 32)
    assert (parsed.tools, parsed.tool_choice, parsed.parallel_tool_calls) == ((), "none", True)
    assert (parsed.chat_template_kwargs, parsed.add_generation_prompt, parsed.continue_final_message) == (
        {},
        True,
        False,
    )
    assert parsed.echo is True and parsed.sampling.max_tokens == 32  # the default applies without max_tokens
    assert parse_request({"messages": USER}, True, 64, None).echo is False


def test_a_chat_keeps_its_tool_choice_and_parallel_calls() -> None:
    body = {"messages": USER, "tools": [NOW], "tool_choice": "required"}
    default = parse_request(body, True, 64, None)
    single = parse_request(body | {"parallel_tool_calls": False}, True, 64, None)
    assert (default.tool_choice, default.parallel_tool_calls) == ("required", True)
    assert (single.tool_choice, single.parallel_tool_calls) == ("required", False)
    assert default.sampling == parse_request(body | {"parallel_tool_calls": True}, True, 64, None).sampling
    assert default.sampling != single.sampling  # a forced call's output allows one call only without parallel
