"""`kvmesh.openai.tools` and the chat fields around it: `tools` / `tool_choice` checked as vLLM checks them,
the schema that forces a call (vLLM's `get_json_schema_from_tools`), the answer's `tool_calls`, the messages'
tool keys and the chat-template options, each bad value a 400 naming it."""

from __future__ import annotations

import copy
import json
from typing import Any

import pytest

from kvmesh.core.errors import InvalidArgument
from kvmesh.openai.messages import Message, parse_messages
from kvmesh.openai.protocol import parse_request, require_plain_chat
from kvmesh.openai.tools import forced_call_schema, forced_calls, forced_choice, parse_tool_fields

pytestmark = pytest.mark.unit
WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "parameters": {
            "type": "object",
            "properties": {"city": {"$ref": "#/$defs/city"}},
            "$defs": {"city": {"type": "string"}},
        },
    },
}
NOW = {"type": "function", "function": {"name": "now"}}
TOOLS = (WEATHER, NOW)
USER = [{"role": "user", "content": "hi"}]


def ids() -> Any:
    n = iter(range(100))
    return lambda: f"call-{next(n)}"


def field_of(body: dict[str, Any]) -> str:
    with pytest.raises(InvalidArgument) as ei:
        parse_request({"messages": USER} | body, True, 64, None)
    return ei.value.field


def test_tool_fields_are_checked_as_vllm_checks_them() -> None:
    assert parse_tool_fields({}) == ((), "none", True)
    assert parse_tool_fields({"tools": list(TOOLS)})[1] == "auto"  # vLLM's default with tools
    assert field_of({"tools": []}) == "tools"
    assert field_of({"tools": [{"type": "function", "function": {"name": ""}}]}) == "tools[0].function.name"
    assert field_of({"tools": [{"type": "code_interpreter"}]}) == "tools[0].type"
    assert field_of({"tools": [{"function": {"name": "f", "parameters": 3}}]}) == "tools[0].function.parameters"
    assert field_of({"tools": [{"function": {"name": "f", "x": 1}}]}) == "tools[0].function.x"
    assert field_of({"tool_choice": "required"}) == "tool_choice"  # no tools
    assert field_of({"tools": [NOW], "tool_choice": "sometimes"}) == "tool_choice"
    assert (
        field_of({"tools": [NOW], "tool_choice": {"type": "function", "function": {}}}) == "tool_choice.function.name"
    )
    assert field_of({"tools": [NOW], "tool_choice": {"type": "function", "function": {"name": "f"}}}) == "tool_choice"
    assert field_of({"tools": [NOW], "parallel_tool_calls": "no"}) == "parallel_tool_calls"
    assert field_of({"functions": [{"name": "f"}]}) == "functions"


def test_the_forced_schemas_are_vllms() -> None:
    tools = copy.deepcopy(TOOLS)
    required = forced_call_schema("required", tools, parallel_tool_calls=True)
    assert tools == TOOLS  # the request's tools (rendered by the template) are left as they were
    assert required == {
        "type": "array",
        "minItems": 1,
        "items": {
            "type": "object",
            "anyOf": [
                {
                    "properties": {
                        "name": {"type": "string", "enum": ["get_weather"]},
                        "parameters": {"type": "object", "properties": {"city": {"$ref": "#/$defs/city"}}},
                    },
                    "required": ["name", "parameters"],
                },
                {
                    "properties": {
                        "name": {"type": "string", "enum": ["now"]},
                        "parameters": {"type": "object", "properties": {}},
                    },
                    "required": ["name", "parameters"],
                },
            ],
        },
        "$defs": {"city": {"type": "string"}},
    }
    assert forced_call_schema("required", tools, parallel_tool_calls=False)["maxItems"] == 1  # type: ignore[index]
    named = {"type": "function", "function": {"name": "get_weather"}}
    assert forced_call_schema(named, tools, True) == WEATHER["function"]["parameters"]  # type: ignore[index]
    assert forced_call_schema({"function": {"name": "now"}}, tools, True) == {"type": "object", "properties": {}}
    assert forced_call_schema("auto", tools, True) is None and forced_call_schema("none", tools, True) is None


@pytest.mark.vllm
def test_the_required_schema_equals_vllms_own() -> None:
    utils = pytest.importorskip("vllm.tool_parsers.utils")
    protocol = pytest.importorskip("vllm.entrypoints.openai.chat_completion.protocol")
    for parallel in (True, False):  # fresh tools each time: vLLM moves the `$defs` out of the ones it is given
        vtools = [protocol.ChatCompletionToolsParam.model_validate(copy.deepcopy(t)) for t in TOOLS]
        theirs = utils.get_json_schema_from_tools("required", vtools, parallel)
        assert forced_call_schema("required", copy.deepcopy(TOOLS), parallel) == theirs


def test_a_forced_call_constrains_the_output() -> None:
    body = {
        "messages": USER,
        "tools": list(TOOLS),
        "tool_choice": "required",
        "response_format": {"type": "json_object"},
    }
    so = parse_request(body, True, 64, None).sampling.structured_output
    assert so is not None and json.loads(so.json_schema or "")["type"] == "array"  # replaces response_format
    named = {"type": "function", "function": {"name": "now"}}
    so = parse_request(body | {"tool_choice": named}, True, 64, None).sampling.structured_output
    assert so is not None and json.loads(so.json_schema or "") == {"type": "object", "properties": {}}
    assert parse_request(body | {"tool_choice": "none"}, True, 64, None).sampling.structured_output is not None
    assert parse_request({"messages": USER, "tools": [NOW]}, True, 64, None).sampling.structured_output is None


def test_the_answer_carries_the_tool_calls() -> None:
    text = '[{"name": "get_weather", "parameters": {"city": "Paris"}}, {"name": "now", "parameters": {}}]'
    choice = {"index": 0, "finish_reason": "stop", "message": {"role": "assistant", "content": text}}
    out = forced_choice(choice, "required", ids())
    assert out["finish_reason"] == "tool_calls" and out["message"]["content"] == ""
    assert out["message"]["tool_calls"] == [
        {"id": "call-0", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}},
        {"id": "call-1", "type": "function", "function": {"name": "now", "arguments": "{}"}},
    ]
    named = {"type": "function", "function": {"name": "get_weather"}}
    out = forced_choice(choice | {"message": {"content": '{"city": "Rome"}'}}, named, ids())
    assert out["finish_reason"] == "stop"  # OpenAI's and vLLM's convention for a named function
    assert out["message"]["tool_calls"][0]["function"] == {"name": "get_weather", "arguments": '{"city": "Rome"}'}
    cut = choice | {"finish_reason": "length", "message": {"content": '[{"name": "now", "par'}}
    assert forced_choice(cut, "required", ids()) == cut  # not a call array: the text, as it came
    assert forced_calls("{}", "required", ids()) is None


def test_messages_carry_the_tool_keys_each_checked() -> None:
    call = {"id": "c1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}
    msgs = [
        *USER,
        {"role": "assistant", "content": None, "tool_calls": [call]},
        {"role": "tool", "tool_call_id": "c1", "content": "sunny"},
    ]
    parsed = parse_messages({"messages": msgs})
    assert parsed[1] == Message("assistant", "", tool_calls=(("c1", "get_weather", '{"city": "Paris"}'),))
    assert parsed[1].template_dict()["tool_calls"][0]["function"]["arguments"] == {"city": "Paris"}  # as vLLM
    assert parsed[2].template_dict() == {"role": "tool", "content": "sunny", "tool_call_id": "c1"}

    def bad(i: int, key: str, value: object) -> str:
        m = copy.deepcopy(msgs)
        m[i][key] = value
        with pytest.raises(InvalidArgument) as ei:
            parse_messages({"messages": m})
        return ei.value.field

    args = "messages[1].tool_calls[0].function.arguments"
    assert bad(1, "tool_calls", [call | {"function": {"name": "f", "arguments": "{oops"}}]) == args
    assert bad(1, "tool_calls", [call | {"function": {"name": "f", "arguments": {"a": 1}}}]) == args
    assert bad(1, "tool_calls", [call | {"function": {"name": "f", "arguments": "[1]"}}]) == args
    assert bad(1, "tool_calls", [call | {"function": {"arguments": "{}"}}]) == "messages[1].tool_calls[0].function.name"
    assert bad(1, "tool_calls", [call | {"type": "custom"}]) == "messages[1].tool_calls[0].type"
    assert bad(1, "tool_calls", [call | {"extra": 1}]) == "messages[1].tool_calls[0].extra"
    assert bad(1, "tool_calls", {"a": 1}) == "messages[1].tool_calls"
    assert bad(0, "tool_calls", [call]) == "messages[0].tool_calls"  # only an assistant's
    assert bad(2, "tool_call_id", 7) == "messages[2].tool_call_id"
    assert bad(0, "name", ["x"]) == "messages[0].name"
    assert bad(1, "tool_calls", [call | {"id": "\ud800"}]) == "messages[1].tool_calls[0].id"


def test_template_options_are_checked_as_vllm_checks_them() -> None:
    r = parse_request({"messages": USER, "chat_template_kwargs": {"enable_thinking": False}}, True, 64, None)
    assert r.chat_template_kwargs == {"enable_thinking": False} and r.add_generation_prompt
    r = parse_request(
        {"messages": USER, "add_generation_prompt": False, "continue_final_message": True}, True, 64, None
    )
    assert r.continue_final_message and not r.add_generation_prompt
    assert field_of({"continue_final_message": True}) == "continue_final_message"  # add_generation_prompt: true
    assert field_of({"chat_template_kwargs": {"chat_template": "x"}}) == "chat_template_kwargs.chat_template"
    assert field_of({"chat_template_kwargs": {"tokenize": True}}) == "chat_template_kwargs.tokenize"
    assert field_of({"chat_template_kwargs": []}) == "chat_template_kwargs"
    assert field_of({"add_generation_prompt": "yes"}) == "add_generation_prompt"
    assert field_of({"chat_template": "{{ messages }}"}) == "chat_template"


def test_a_plain_chat_server_refuses_what_it_cannot_render() -> None:
    def refused(body: dict[str, Any]) -> str:
        with pytest.raises(InvalidArgument) as ei:
            require_plain_chat(parse_request({"messages": USER} | body, True, 64, None))
        return ei.value.field

    require_plain_chat(parse_request({"messages": USER}, True, 64, None))
    assert refused({"tools": [NOW], "tool_choice": "none"}) == "tools"
    assert refused({"chat_template_kwargs": {"x": 1}}) == "chat_template_kwargs"
    assert refused({"add_generation_prompt": False}) == "add_generation_prompt"
    assert refused({"messages": [{"role": "tool", "tool_call_id": "c1", "content": "3"}]}) == "messages[0].tool_call_id"
