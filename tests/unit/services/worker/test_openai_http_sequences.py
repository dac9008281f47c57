"""The worker's own OpenAI HTTP API over the simulated engine: `n` choices, log-probabilities in OpenAI's
chat and completions shapes, streamed and whole; what only the router serves is refused, not dropped.

The request parser (`kvmesh.openai.protocol`) decides which of `n` / `logprobs` a client may ask for; here
they are set on the parsed request directly, so these tests check the worker's answers whatever it allows."""

from __future__ import annotations

import dataclasses
import json
from collections.abc import AsyncIterator
from typing import Any

import pytest
import pytest_asyncio
from aiohttp import web
from aiohttp.test_utils import TestClient, TestServer

from kvmesh.engine.clock import VirtualClock
from kvmesh.engine.sim.core import SimConfig
from kvmesh.engine.sim.driver import SimEngine
from kvmesh.openai import protocol
from kvmesh.services.worker import openai_http
from kvmesh.services.worker.openai_http import OpenAIApi

pytestmark = pytest.mark.unit
EXTRA = ("n", "logprobs")  # given to the engine past the parser


@pytest.fixture(autouse=True)
def past_the_parser(monkeypatch: pytest.MonkeyPatch) -> None:
    def parse(body: dict[str, Any], chat: bool, **kw: Any) -> protocol.OpenAIRequest:
        rest = {k: v for k, v in body.items() if k not in (*EXTRA, "top_logprobs")}
        parsed = protocol.parse_request(rest, chat, **kw)
        extra = {k: body[k] for k in EXTRA if k in body}
        if chat and "logprobs" in extra:
            extra["logprobs"] = body.get("top_logprobs", 0)
        return dataclasses.replace(parsed, sampling=dataclasses.replace(parsed.sampling, **extra))

    monkeypatch.setattr(openai_http, "parse_request", parse)


@pytest_asyncio.fixture
async def client() -> AsyncIterator[TestClient]:
    eng = SimEngine(SimConfig(block_size=16, num_blocks=256), clock=VirtualClock())
    await eng.start()
    app = web.Application()
    OpenAIApi(eng, "sim").add_routes(app)
    try:
        async with TestClient(TestServer(app, host="127.0.0.1", port=0)) as c:
            yield c
    finally:
        await eng.stop()


def sse_events(raw: str) -> list[dict[str, Any]]:
    lines = [line[6:] for line in raw.splitlines() if line.startswith("data: ")]
    return [json.loads(x) for x in lines if x != "[DONE]"]


async def test_whole_chat_has_a_choice_per_sequence_with_logprobs(client: TestClient) -> None:
    body = {"messages": [{"role": "user", "content": "hi"}], "n": 2, "max_tokens": 3, "logprobs": True}
    r = await client.post("/v1/chat/completions", json=body | {"top_logprobs": 2, "temperature": 1.0})
    got = await r.json()
    assert r.status == 200, got
    assert [c["index"] for c in got["choices"]] == [0, 1]
    for c in got["choices"]:
        content = c["logprobs"]["content"]
        assert len(content) == 3 and all(len(x["top_logprobs"]) == 2 for x in content)
        assert c["finish_reason"] == "length"
    assert got["usage"]["completion_tokens"] == 6


async def test_streamed_completion_sends_every_choice(client: TestClient) -> None:
    body = {"prompt": "hello", "n": 2, "max_tokens": 3, "logprobs": 1, "stream": True, "temperature": 1.0}
    r = await client.post("/v1/completions", json=body)
    assert r.status == 200
    chunks = sse_events(await r.text())
    by_index: dict[int, list[dict[str, Any]]] = {}
    for ch in chunks:
        for c in ch["choices"]:
            by_index.setdefault(c["index"], []).append(c)
    assert sorted(by_index) == [0, 1]
    for cs in by_index.values():
        assert [c["finish_reason"] for c in cs][-1] == "length"
        assert sum(len(c["logprobs"]["tokens"]) for c in cs) == 3


async def test_a_batch_of_prompts_is_refused(client: TestClient) -> None:
    r = await client.post("/v1/completions", json={"prompt": ["a", "b"], "max_tokens": 2})
    assert r.status == 400
