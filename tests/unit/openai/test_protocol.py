"""`kvmesh.openai`: request parsing with one set of bounds (the engines' and gRPC's), response objects, SSE
framing and the HTTP error table."""

from __future__ import annotations

import json
from typing import Any

import pytest

from kvmesh.core import errors
from kvmesh.core.errors import InvalidArgument
from kvmesh.core.generation import Usage
from kvmesh.core.sampling import TEMPERATURE_MAX
from kvmesh.openai.errors import http_error, status_and_type
from kvmesh.openai.messages import Message, parse_messages
from kvmesh.openai.prompts import parse_prompts
from kvmesh.openai.protocol import parse_request
from kvmesh.openai.responses import SSE_DONE, ResponseBuilder, sse_event, usage_json
from kvmesh.openai.sampling_fields import parse_sampling
from kvmesh.services.router.frontend import Frontend
from kvmesh.services.worker.openai_http import render_chat
from kvmesh.services.worker.servicer import validate_generate
from kvmesh.v1 import common_pb2, worker_pb2

pytestmark = pytest.mark.unit


def field_of(fn: Any, *args: Any) -> str:
    with pytest.raises(InvalidArgument) as ei:
        fn(*args)
    return ei.value.field


def test_openai_helpers() -> None:
    messages = parse_messages({"messages": [{"role": "user", "content": "hi"}]})
    assert render_chat(messages) == "<|user|>\nhi\n<|assistant|>\n"
    with pytest.raises(InvalidArgument):
        parse_messages({"messages": []})
    assert parse_prompts({"prompt": [1, 2]}) == (((1, 2), None),)
    assert parse_prompts({"prompt": ["abc"]}) == ((None, "abc"),)
    with pytest.raises(InvalidArgument) as ei:
        parse_prompts({"prompt": 5})
    assert ei.value.field == "prompt"
    sp = parse_sampling({"max_tokens": 7, "stop": "x", "temperature": 0}, False, None, 16)
    assert sp.max_tokens == 7 and sp.stop == ("x",) and sp.temperature == 0.0
    assert parse_sampling({}, True, None, None).max_tokens is None
    assert parse_sampling({}, False, None, 16).max_tokens == 16
    with pytest.raises(InvalidArgument) as ei:
        parse_request({"prompt": "x", "n": 0}, False, None, 16)
    assert ei.value.field == "n"


def test_messages_text_parts_and_bad_entries() -> None:
    parts = {"messages": [{"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]}]}
    assert parse_messages(parts) == (Message("user", "ab"),)
    assert field_of(parse_messages, {"messages": [{"content": "x"}]}) == "messages[0]"
    assert field_of(parse_messages, {"messages": [{"role": "user", "content": 3}]}) == "messages[0].content"
    assert field_of(parse_messages, {}) == "messages"


@pytest.mark.parametrize(
    ("body", "field"),
    [
        ({"temperature": TEMPERATURE_MAX + 0.5}, "temperature"),  # HTTP cap = vLLM's 2 (was 2 here, none on the worker)
        ({"temperature": -0.1}, "temperature"),
        ({"temperature": float("nan")}, "temperature"),
        ({"temperature": "hot"}, "temperature"),
        ({"top_p": 0}, "top_p"),
        ({"top_p": 1.5}, "top_p"),
        ({"top_k": -2}, "top_k"),
        ({"top_k": 1.5}, "top_k"),
        ({"max_tokens": 0}, "max_tokens"),
        ({"max_tokens": 101}, "max_tokens"),
        ({"max_tokens": True}, "max_tokens"),
        ({"min_tokens": -1}, "min_tokens"),
        ({"max_tokens": 5, "min_tokens": 6}, "min_tokens"),
        ({"seed": -1}, "seed"),
        ({"seed": 2**63}, "seed"),
        ({"stop": 5}, "stop"),
        ({"stop": ["a", 1]}, "stop"),
        ({"stop": [""]}, "stop"),
        ({"stop_token_ids": [-1]}, "stop_token_ids"),
        ({"stop_token_ids": "1"}, "stop_token_ids"),
        ({"ignore_eos": "yes"}, "ignore_eos"),
        ({"presence_penalty": 3}, "presence_penalty"),
        ({"frequency_penalty": -2.5}, "frequency_penalty"),
    ],
)
def test_sampling_bounds_name_the_field(body: dict[str, Any], field: str) -> None:
    assert field_of(parse_sampling, body, False, 100, 16) == field


def test_sampling_at_the_bounds_is_accepted() -> None:
    body = {"temperature": TEMPERATURE_MAX, "top_p": 1, "top_k": -1, "max_tokens": 100, "min_tokens": 100}
    sp = parse_sampling(body | {"seed": 2**63 - 1, "stop_token_ids": [2], "ignore_eos": True}, False, 100, 16)
    assert (sp.temperature, sp.top_p, sp.top_k, sp.max_tokens, sp.seed) == (2.0, 1.0, -1, 100, 2**63 - 1)
    assert sp.ignore_eos and sp.stop_token_ids == (2,)
    chat = parse_sampling({"max_completion_tokens": 3, "max_tokens": 9}, True, 100, None)
    assert chat.max_tokens == 3


def test_grpc_shares_the_temperature_cap() -> None:
    """gRPC capped temperature at 10 on the router and the worker while router HTTP capped it at 2 (the bug);
    now every door refuses what vLLM refuses."""
    hot = common_pb2.SamplingParams(temperature=2.5)
    assert field_of(Frontend.check_sampling, hot) == "temperature"
    req = worker_pb2.GenerateRequest(request_id="r", token_ids=common_pb2.TokenIds(ids=[1]), sampling=hot)
    assert field_of(validate_generate, req) == "sampling.temperature"
    Frontend.check_sampling(common_pb2.SamplingParams(temperature=2.0))  # top_p 0 = unset: accepted
    assert field_of(Frontend.check_sampling, common_pb2.SamplingParams(top_p=1.5)) == "top_p"


def test_parse_request_completion_and_chat() -> None:
    r = parse_request(
        {"model": "m", "prompt": "hi", "stream": True, "stream_options": {"include_usage": True}, "user": "u"},
        chat=False,
        max_tokens_limit=100,
        default_max_tokens=None,
    )
    assert (r.model, r.prompt_text, r.prompt_ids, r.user) == ("m", "hi", None, "u")
    assert r.stream and r.include_usage
    c = parse_request({"messages": [{"role": "user", "content": "x"}], "session_id": "s"}, True, 100, None)
    assert c.chat and c.messages == (Message("user", "x"),) and c.user == "s" and not c.stream
    assert field_of(parse_request, {"model": 3, "prompt": "x"}, False, 100, None) == "model"
    assert field_of(parse_request, {"prompt": ""}, False, 100, None) == "prompt"
    assert field_of(parse_request, {"prompt": [1, -2]}, False, 100, None) == "prompt"
    assert field_of(parse_request, {"prompt": [True]}, False, 100, None) == "prompt"
    assert field_of(parse_request, {"prompt": "x", "stream_options": 1}, False, 100, None) == "stream_options"


def test_response_objects_and_sse_framing() -> None:
    u = Usage(prompt_tokens=5, cached_tokens=4, completion_tokens=2)
    assert usage_json(u) == {
        "prompt_tokens": 5,
        "completion_tokens": 2,
        "total_tokens": 7,
        "prompt_tokens_details": {"cached_tokens": 4},
    }
    assert usage_json(None)["total_tokens"] == 0
    chat = ResponseBuilder("id1", chat=True, created=9, model="m")
    whole = chat.whole("ok", "stop", u)
    assert whole["object"] == "chat.completion"
    assert whole["choices"][0]["message"] == {"role": "assistant", "content": "ok"}
    assert chat.chunk("a", None, first=True)["choices"][0]["delta"] == {"role": "assistant", "content": "a"}
    assert chat.chunk("b", "length", first=False)["choices"][0] == {
        "index": 0,
        "finish_reason": "length",
        "logprobs": None,
        "delta": {"content": "b"},
    }
    text = ResponseBuilder("id2", chat=False, created=9, model="m")
    assert "usage" not in text.chunk("t", None, first=True)
    assert text.usage_chunk(u) | {"usage": None} == {
        "id": "id2",
        "created": 9,
        "model": "m",
        "object": "text_completion",
        "choices": [],
        "usage": None,
    }
    ev = sse_event({"a": 1})
    assert ev.startswith(b"data: ") and ev.endswith(b"\n\n") and json.loads(ev[6:]) == {"a": 1}
    assert SSE_DONE == b"data: [DONE]\n\n"


@pytest.mark.parametrize(
    ("exc", "status", "etype"),
    [
        (errors.InvalidArgument("top_p", "bad"), 400, "invalid_request_error"),
        (errors.Unauthenticated("no key"), 401, "authentication_error"),
        (errors.PermissionDenied("no"), 403, "permission_error"),
        (errors.NotFound("no model"), 404, "not_found_error"),
        (errors.ResourceExhausted("slow down", 0.2), 429, "rate_limit_error"),
        (errors.Unavailable("down"), 503, "service_unavailable"),
        (errors.DeadlineExceeded("late"), 504, "timeout_error"),
        (errors.Unimplemented("later"), 501, "not_implemented_error"),
        (KeyError("secret internals"), 500, "server_error"),
    ],
)
def test_http_error_table(exc: BaseException, status: int, etype: str) -> None:
    err = http_error(exc)
    assert (err.status, err.body["error"]["type"], err.body["error"]["code"]) == (status, etype, status)
    assert set(err.body["error"]) == {"message", "type", "param", "code"}
    assert status_and_type(exc) == (status, etype)
    assert err.body["error"]["param"] == ("top_p" if status == 400 else None)
    assert ("Retry-After" in err.headers) == (status == 429)
    if status == 429:
        assert err.headers["Retry-After"] == "1"
    if status == 500:
        assert "secret" not in err.body["error"]["message"]


@pytest.mark.parametrize(
    ("body", "field"),
    [
        ({"prompt": [5], "n": 17}, "n"),
        ({"prompt": [5], "n": True}, "n"),  # True == 1 in Python, but it is not the integer 1
        ({"prompt": [5], "best_of": 2}, "best_of"),
        ({"prompt": [5], "logprobs": 21}, "logprobs"),
        ({"prompt": [5], "logprobs": -1}, "logprobs"),
        ({"prompt": [5], "logprobs": True}, "logprobs"),
        ({"prompt": [5], "echo": 1}, "echo"),
        ({"prompt": [5], "suffix": "s"}, "suffix"),
        ({"prompt": [5], "logit_bias": {"x": 1}}, "logit_bias"),
        ({"prompt": [5], "logit_bias": {"5": "1"}}, "logit_bias"),
        ({"prompt": [5], "logit_bias": [5]}, "logit_bias"),
        ({"prompt": [5], "top_logprobs": 0}, "top_logprobs"),  # a chat field, unknown to completions
        ({"prompt": [5], "tools": []}, "tools"),
        ({"prompt": "\ud800"}, "prompt"),
        ({"prompt": [5], "stop": ["ok", "\udfff"]}, "stop"),
        ({"prompt": [5], "user": "\ud800"}, "user"),
        ({"prompt": [True]}, "prompt"),
        ({"prompt": [5], "stop_token_ids": [False]}, "stop_token_ids"),
    ],
)
def test_unsupported_fields_surrogates_and_booleans_name_the_field(body: dict[str, Any], field: str) -> None:
    assert field_of(parse_request, body, False, 64, None) == field


def test_chat_unsupported_and_surrogates_name_the_field() -> None:
    chat = [{"role": "user", "content": "hi"}]
    assert field_of(parse_request, {"messages": chat, "top_logprobs": 2}, True, 64, None) == "top_logprobs"
    assert field_of(parse_request, {"messages": chat, "prompt": "x"}, True, 64, None) == "prompt"
    bad = [{"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "\ud800"}]}]
    assert field_of(parse_request, {"messages": bad}, True, 64, None) == "messages[0].content[1].text"
    five = [{"role": "user", "content": [{"type": "text", "text": 5}]}]
    assert field_of(parse_request, {"messages": five}, True, 64, None) == "messages[0].content[0].text"


def test_off_values_of_unsupported_fields_are_accepted() -> None:
    off = {"n": 1, "best_of": 1, "logprobs": None, "echo": False, "suffix": None, "logit_bias": {}}
    assert parse_request({"prompt": [5], **off}, False, 64, None).prompt_ids == (5,)
    nulls = dict.fromkeys(off)
    assert parse_request({"prompt": [5], **nulls}, False, 64, None).prompt_ids == (5,)
    chat = {"messages": [{"role": "user", "content": "hi"}], "logprobs": False, "top_logprobs": 0, "n": 1}
    assert parse_request(chat, True, 64, None).messages == (Message("user", "hi"),)
    assert parse_request({"prompt": [5], "repetition_penalty": 1.2}, False, 64, None).sampling.repetition_penalty == 1.2
