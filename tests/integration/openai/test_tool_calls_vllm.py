"""Tool calls end to end: the router (`--tool-call-parser hermes`, the tiny model's Hermes-style template) over
a vLLM worker. A named function and "required" are forced by structured outputs on the worker: the answer is
a call of that function whose arguments are JSON (or, cut by `max_tokens`, finish_reason `length`); "auto"
runs vLLM's hermes parser over the (random-weight) model's text; the tools reach the prompt (/tokenize
counts them). A few dozen tokens per request, one worker.
"""

from __future__ import annotations

import contextlib
import json
from collections.abc import Iterator
from typing import Any

import httpx
import pytest

from kvmesh.suite.launcher import start_service
from tests.support.models import SHARED_BLOCK_SIZE, SharedVllmWorker, tiny_model

pytestmark = [pytest.mark.integration, pytest.mark.vllm, pytest.mark.slow]
ENV = {"HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "VLLM_CPU_KVCACHE_SPACE": "1"}
WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
    },
}
CHAT: dict[str, Any] = {
    "messages": [{"role": "user", "content": "weather in Paris?"}],
    "tools": [WEATHER],
    "max_tokens": 48,
    "temperature": 0,
}


@pytest.fixture(scope="module")
def router(tmp_path_factory: pytest.TempPathFactory, shared_vllm_worker: SharedVllmWorker) -> Iterator[httpx.Client]:
    """The module's router over the vLLM worker other modules share (`SharedVllmWorker`: its max_model_len
    leaves room for the ~520-token tools prompt and the answer)."""
    model, tmp = tiny_model(), tmp_path_factory.mktemp("tools")
    worker = shared_vllm_worker.get()
    rargs = ["--workers", worker.address, "--block-size", str(SHARED_BLOCK_SIZE), "--model", model]
    router = start_service("router", tmp / "svc", *rargs, "--tool-call-parser", "hermes", env=ENV, timeout=120)
    try:
        with httpx.Client(base_url=f"http://127.0.0.1:{router.http_port}", timeout=120) as client:
            yield client
    finally:
        with contextlib.suppress(Exception):
            router.terminate(timeout=30)


def answer(client: httpx.Client, body: dict[str, Any]) -> dict[str, Any]:
    r = client.post("/v1/chat/completions", json=body)
    assert r.status_code == 200, r.text
    choice: dict[str, Any] = r.json()["choices"][0]
    return choice


def test_a_named_function_is_called_with_json_arguments(router: httpx.Client) -> None:
    named = {"type": "function", "function": {"name": "get_weather"}}
    choice = answer(router, CHAT | {"tool_choice": named})
    if choice["finish_reason"] == "length":
        return  # the random weights may not close the object within max_tokens: vLLM's answer too
    assert choice["finish_reason"] == "stop" and choice["message"]["content"] == ""
    (call,) = choice["message"]["tool_calls"]
    assert call["type"] == "function" and call["id"] and call["function"]["name"] == "get_weather"
    assert isinstance(json.loads(call["function"]["arguments"]), dict)


def test_required_calls_one_of_the_tools(router: httpx.Client) -> None:
    choice = answer(router, CHAT | {"tool_choice": "required", "parallel_tool_calls": False})
    if choice["finish_reason"] == "length":
        return
    assert choice["finish_reason"] == "tool_calls"
    (call,) = choice["message"]["tool_calls"]
    assert call["function"]["name"] == "get_weather" and isinstance(json.loads(call["function"]["arguments"]), dict)


def test_a_streamed_named_call_joins_into_the_whole_one(router: httpx.Client) -> None:
    named = {"type": "function", "function": {"name": "get_weather"}}
    args, names, finish = "", set(), None
    with router.stream("POST", "/v1/chat/completions", json=CHAT | {"tool_choice": named, "stream": True}) as r:
        assert r.status_code == 200
        for line in r.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            for c in json.loads(line[6:])["choices"]:
                for tc in c["delta"].get("tool_calls", []):
                    names.add(tc["function"].get("name"))
                    args += tc["function"].get("arguments", "")
                finish = c["finish_reason"] or finish
    assert "get_weather" in names
    assert finish == "length" or isinstance(json.loads(args), dict)


def test_auto_runs_the_parser_and_the_tools_reach_the_prompt(router: httpx.Client) -> None:
    choice = answer(router, CHAT | {"max_tokens": 8})
    assert choice["finish_reason"] in ("stop", "length", "tool_calls")
    assert choice["message"]["tool_calls"] if choice["finish_reason"] == "tool_calls" else True
    plain = router.post("/tokenize", json={"messages": CHAT["messages"]}).json()["count"]
    with_tools = router.post("/v1/chat/completions", json=CHAT | {"max_tokens": 1}).json()["usage"]["prompt_tokens"]
    assert with_tools > plain + 50  # the Hermes tools prompt is in the prompt
    r = router.post("/v1/chat/completions", json=CHAT | {"tool_choice": "sometimes"})
    assert r.status_code == 400 and r.json()["error"]["param"] == "tool_choice"
