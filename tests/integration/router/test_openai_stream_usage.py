"""The router's SSE streams carry `usage` only when `stream_options.include_usage` asks for it, as a last
chunk with empty `choices` (OpenAI's and vLLM's place, where `vllm bench serve` reads it); content parts
and `max_completion_tokens` are honoured. Real router and simulated worker processes on loopback."""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import Any

import httpx
import pytest

from kvmesh.suite.launcher import ServiceProcess

pytestmark = pytest.mark.integration
CHAT = {"messages": [{"role": "user", "content": [{"type": "text", "text": "hi"}]}], "ignore_eos": True}


def events(router: ServiceProcess, path: str, body: dict[str, Any]) -> list[dict[str, Any]]:
    with httpx.Client(timeout=30) as c, c.stream("POST", f"http://127.0.0.1:{router.http_port}{path}", json=body) as s:
        assert s.status_code == 200, s.read()
        data = [ln[6:] for ln in s.iter_lines() if ln.startswith("data: ")]
    assert data[-1] == "[DONE]"
    return [json.loads(d) for d in data[:-1]]


@pytest.mark.parametrize(
    ("path", "body"),
    [
        ("/v1/chat/completions", CHAT | {"max_completion_tokens": 3}),
        ("/v1/completions", {"prompt": "hi", "max_tokens": 3, "ignore_eos": True}),
    ],
    ids=["chat", "completions"],
)
def test_usage_only_when_asked(services: Callable[..., ServiceProcess], path: str, body: dict[str, Any]) -> None:
    worker = services("worker", "--engine", "sim", "--block-size", "32", "--kv-blocks", "1024", "--sim-speed", "0")
    router = services("router", "--workers", worker.address, "--block-size", "32")
    plain = events(router, path, body | {"stream": True})
    assert all("usage" not in c for c in plain) and plain[-1]["choices"][0]["finish_reason"] == "length"
    off = events(router, path, body | {"stream": True, "stream_options": {"include_usage": False}})
    assert all("usage" not in c for c in off)
    on = events(router, path, body | {"stream": True, "stream_options": {"include_usage": True}})
    assert all("usage" not in c for c in on[:-1])
    assert on[-1]["choices"] == [] and on[-1]["usage"]["completion_tokens"] == 3
    assert on[-1]["object"] == on[0]["object"] and on[-1]["id"] == on[0]["id"]
    assert 1 <= len([c for c in on if c["choices"]]) <= 3  # the limit honoured (a chunk may carry several)
