"""The router's tool calls, reasoning and chat template: the model's template rendered with tools and vLLM's
options (the tiny model's Hermes-style one), "auto" refused without `--tool-call-parser`, forced calls whole
and streamed, and vLLM's own parsers (hermes; deepseek_r1 with hermes) reading canned answers, whole and
streamed."""

from __future__ import annotations

import json
from typing import Any

import pytest

from kvmesh.core.errors import InvalidArgument
from kvmesh.core.modelfiles import resolve_model_dir
from kvmesh.openai.protocol import OpenAIRequest, parse_request
from kvmesh.services.router.chunks import Chunk
from kvmesh.services.router.tokenize import RouterTokenizer
from kvmesh.services.router.tool_parsing import OutputParser, parsed_answer

pytestmark = pytest.mark.unit
WEATHER = {
    "type": "function",
    "function": {"name": "get_weather", "parameters": {"type": "object", "properties": {"city": {"type": "string"}}}},
}
HERMES_ANSWER = 'Let me look. <tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'


def chat(**extra: Any) -> OpenAIRequest:
    return parse_request({"messages": [{"role": "user", "content": "weather?"}]} | extra, True, 64, None)


def stream(answer: Any, pieces: list[str], finish: str = "stop", tok: Any = None) -> list[dict[str, Any]]:
    """The choices `answer` sends for a sequence streamed in `pieces` (the first delta with the role), each
    piece's token ids from `tok` when given (the reasoning parsers see the end of reasoning in them)."""
    sent = []
    for i, text in enumerate(pieces):
        last = i == len(pieces) - 1
        delta = ({"role": "assistant"} if i == 0 else {}) | {"content": text}
        payload = {"id": "x", "choices": [{"index": 0, "finish_reason": finish if last else None, "delta": delta}]}
        ids = tok.encode(text, add_special_tokens=False) if tok is not None else []
        out = answer.chunk(payload, Chunk(ids, text, "w", 0))
        sent += out["choices"] if out is not None else []
    return sent


def joined_calls(sent: list[dict[str, Any]]) -> dict[int, dict[str, str]]:
    """The streamed tool-call deltas joined per index, as a client joins them."""
    calls: dict[int, dict[str, str]] = {}
    for c in sent:
        for tc in c["delta"].get("tool_calls", []):
            got = calls.setdefault(tc["index"], {"name": "", "arguments": ""})
            got["name"] += tc.get("function", {}).get("name", "")
            got["arguments"] += tc.get("function", {}).get("arguments", "")
    return calls


def test_auto_needs_a_parser_and_none_is_text() -> None:
    with pytest.raises(InvalidArgument) as ei:
        parsed_answer(chat(tools=[WEATHER]), None)
    assert ei.value.field == "tool_choice" and "--tool-call-parser" in ei.value.message
    assert parsed_answer(chat(tools=[WEATHER], tool_choice="none"), None) is None
    assert parsed_answer(chat(), None) is None


def test_forced_calls_streamed() -> None:
    named = {"type": "function", "function": {"name": "get_weather"}}
    sent = stream(parsed_answer(chat(tools=[WEATHER], tool_choice=named), None), ['{"city"', ': "Rome"}', ""])
    assert sent[0]["delta"]["role"] == "assistant" and sent[0]["delta"]["tool_calls"][0]["id"]
    assert joined_calls(sent) == {0: {"name": "get_weather", "arguments": '{"city": "Rome"}'}}
    assert sent[-1]["finish_reason"] == "stop"  # a named function's answer ends `stop`, as vLLM's
    text = ['[{"name": "get_weather", ', '"parameters": {"city": "Oslo"}}]']
    sent = stream(parsed_answer(chat(tools=[WEATHER], tool_choice="required"), None), text)
    assert joined_calls(sent) == {0: {"name": "get_weather", "arguments": '{"city": "Oslo"}'}}
    assert sent[-1]["finish_reason"] == "tool_calls"
    sent = stream(parsed_answer(chat(tools=[WEATHER], tool_choice="required"), None), ['[{"na'], "length")
    assert sent[-1]["delta"]["content"] == '[{"na' and sent[-1]["finish_reason"] == "length"


def test_the_template_renders_tools_and_options() -> None:
    tok = RouterTokenizer()
    if tok.model_dir is None:
        pytest.skip("no tiny model (scripts/build_tiny_model.py)")
    call = {"id": "c1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}
    history = [
        {"role": "user", "content": "weather?"},
        {"role": "assistant", "content": None, "tool_calls": [call]},
        {"role": "tool", "tool_call_id": "c1", "content": "sunny"},
    ]
    r = parse_request({"messages": history, "tools": [WEATHER]}, True, 64, None)
    text = tok.render_chat(r.messages, r.tools)
    assert "<tools>\n" + json.dumps(WEATHER) + "\n</tools>" in text
    assert '<|assistant|>\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>\n' in text
    assert text.endswith("<|tool|>\n<tool_response>\nsunny\n</tool_response>\n<|assistant|>\n")
    plain = chat().messages
    assert tok.render_chat(plain) == "<s><|user|>\nweather?\n<|assistant|>\n"  # without tools as it always was
    assert tok.render_chat(plain, add_generation_prompt=False) == "<s><|user|>\nweather?\n"
    opened = parse_request(
        {"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "Hel"}]}, True, 64, None
    ).messages
    assert tok.render_chat(opened, add_generation_prompt=False, continue_final_message=True).endswith("Hel")
    assert tok.render_chat(plain, template_kwargs={"unread": 1}) == tok.render_chat(plain)  # vLLM drops unread ones


@pytest.mark.vllm
def test_hermes_parses_a_canned_answer_whole_and_streamed() -> None:
    pytest.importorskip("vllm")
    model = resolve_model_dir("")
    if model is None:
        pytest.skip("no tiny model (scripts/build_tiny_model.py)")
    parser = OutputParser("hermes", "", model)
    r = chat(tools=[WEATHER])
    answer = parsed_answer(r, parser)
    assert answer is not None
    assert r.sampling.skip_special_tokens and not answer.parsed.sampling.skip_special_tokens  # hermes' adjustment
    body = {
        "choices": [{"index": 0, "finish_reason": "stop", "message": {"role": "assistant", "content": HERMES_ANSWER}}]
    }
    choice = answer.whole(body)["choices"][0]
    assert choice["finish_reason"] == "tool_calls" and choice["message"]["content"] == "Let me look. "
    (tc,) = choice["message"]["tool_calls"]
    assert tc["type"] == "function" and tc["id"] and tc["function"]["name"] == "get_weather"
    assert json.loads(tc["function"]["arguments"]) == {"city": "Paris"}
    plain = {"choices": [{"index": 0, "finish_reason": "stop", "message": {"role": "assistant", "content": "no"}}]}
    assert answer.whole(plain) == plain
    cut = [HERMES_ANSWER[i : i + 7] for i in range(0, len(HERMES_ANSWER), 7)]
    sent = stream(parsed_answer(r, parser), cut)
    assert "".join(c["delta"].get("content", "") for c in sent) == "Let me look. "
    (call,) = joined_calls(sent).values()
    assert call["name"] == "get_weather" and json.loads(call["arguments"]) == {"city": "Paris"}
    assert sent[-1]["finish_reason"] == "tool_calls"
    with pytest.raises(InvalidArgument):
        OutputParser("no-such-parser", "", model)


@pytest.mark.vllm
def test_reasoning_and_tool_calls_parsed_together() -> None:
    pytest.importorskip("vllm")
    model = resolve_model_dir("")
    if model is None:
        pytest.skip("no tiny model (scripts/build_tiny_model.py)")
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(model))
    tok.add_tokens(["<think>", "</think>"], special_tokens=True)  # in memory: what a reasoning model's vocabulary has
    parser = OutputParser("hermes", "deepseek_r1", model, tokenizer=tok)
    text = "<think>Paris, so get_weather.</think>" + HERMES_ANSWER
    body = {"choices": [{"index": 0, "finish_reason": "stop", "message": {"role": "assistant", "content": text}}]}
    answer = parsed_answer(chat(tools=[WEATHER]), parser)
    assert answer is not None
    msg = answer.whole(body)["choices"][0]["message"]
    assert msg["reasoning"] == "Paris, so get_weather." and msg["content"] == "Let me look. "
    assert json.loads(msg["tool_calls"][0]["function"]["arguments"]) == {"city": "Paris"}
    no_tools = parsed_answer(chat(), parser)  # reasoning is read from every chat answer
    assert no_tools is not None
    plain = {"choices": [{"index": 0, "finish_reason": "stop", "message": {"content": "<think>hm</think>Hi."}}]}
    assert no_tools.whole(plain)["choices"][0]["message"] == {"content": "Hi.", "reasoning": "hm"}
    pieces = ["<think>", "hm", "</think>", "Hi", "."]
    sent = stream(parsed_answer(chat(), parser), pieces, tok=tok)
    assert "".join(c["delta"].get("reasoning", "") for c in sent) == "hm"
    assert "".join(c["delta"].get("content", "") for c in sent) == "Hi."
    with pytest.raises(InvalidArgument) as ei:
        OutputParser("", "deepseek_r1", model)  # the tiny model has no <think> token
    assert ei.value.field == "reasoning_parser"
