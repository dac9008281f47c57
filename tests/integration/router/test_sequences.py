"""`n > 1`, log-probabilities, completions batches and echo through the router, over sim workers: the HTTP
API's OpenAI shapes (one choice per sequence of each prompt, usage over all of them) and the gRPC stream's
`index` / `logprobs` through `kvmesh.client`. Real router and simulated worker processes on loopback."""

from __future__ import annotations

import asyncio
import json
from collections.abc import Callable
from typing import Any

import httpx
import pytest

from kvmesh.client.aio import AsyncClient
from kvmesh.suite.launcher import ServiceProcess
from kvmesh.v1 import common_pb2, router_pb2

pytestmark = pytest.mark.integration
SIM = ("--engine", "sim", "--block-size", "32", "--kv-blocks", "1024", "--sim-speed", "0")


def router_over(services: Callable[..., ServiceProcess], n_workers: int = 2) -> ServiceProcess:
    workers = [services("worker", *SIM) for _ in range(n_workers)]
    return services("router", "--workers", ",".join(w.address for w in workers), "--block-size", "32")


def post(router: ServiceProcess, path: str, body: dict[str, Any]) -> dict[str, Any]:
    r = httpx.post(f"http://127.0.0.1:{router.http_port}{path}", json=body, timeout=30)
    assert r.status_code == 200, r.text
    out: dict[str, Any] = r.json()
    return out


def events(router: ServiceProcess, path: str, body: dict[str, Any]) -> list[dict[str, Any]]:
    url = f"http://127.0.0.1:{router.http_port}{path}"
    with httpx.Client(timeout=30) as c, c.stream("POST", url, json=body | {"stream": True}) as s:
        assert s.status_code == 200, s.read()
        data = [ln[6:] for ln in s.iter_lines() if ln.startswith("data: ")]
    assert data[-1] == "[DONE]"
    return [json.loads(d) for d in data[:-1]]


def test_http_n_2_whole_and_streamed(services: Callable[..., ServiceProcess]) -> None:
    router = router_over(services)
    body = {"prompt": "hello there", "max_tokens": 3, "ignore_eos": True, "n": 2}
    whole = post(router, "/v1/completions", body)
    assert [c["index"] for c in whole["choices"]] == [0, 1]
    assert all(c["finish_reason"] == "length" for c in whole["choices"])
    assert whole["usage"]["completion_tokens"] == 6  # every sequence counts
    streamed = events(router, "/v1/completions", body | {"stream_options": {"include_usage": True}})
    finishes = {c["choices"][0]["index"]: c["choices"][0]["finish_reason"] for c in streamed if c["choices"]}
    assert finishes == {0: "length", 1: "length"} and streamed[-1]["usage"]["completion_tokens"] == 6


def test_http_chat_logprobs(services: Callable[..., ServiceProcess]) -> None:
    router = router_over(services, 1)
    chat = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 3, "ignore_eos": True}
    lp = post(router, "/v1/chat/completions", chat | {"logprobs": True, "top_logprobs": 2})
    content = lp["choices"][0]["logprobs"]["content"]
    assert len(content) == 3 and all({"token", "logprob", "bytes", "top_logprobs"} <= set(e) for e in content)
    assert all(len(e["top_logprobs"]) == 2 for e in content)


def test_http_completions_batch(services: Callable[..., ServiceProcess]) -> None:
    router = router_over(services)
    batch = post(router, "/v1/completions", {"prompt": ["a b c", "d e f"], "max_tokens": 2, "ignore_eos": True})
    assert [c["index"] for c in batch["choices"]] == [0, 1] and batch["usage"]["completion_tokens"] == 4
    streamed = events(router, "/v1/completions", {"prompt": ["a b c", "d e f"], "max_tokens": 2, "ignore_eos": True})
    assert {c["choices"][0]["index"] for c in streamed if c["choices"][0]["finish_reason"]} == {0, 1}


def test_http_echo_with_logprobs(services: Callable[..., ServiceProcess]) -> None:
    router = router_over(services, 1)
    echo = post(router, "/v1/completions", {"prompt": "echo me", "max_tokens": 2, "echo": True, "logprobs": 1})
    choice = echo["choices"][0]
    assert choice["text"].startswith("echo me")
    assert choice["logprobs"]["token_logprobs"][0] is None  # the prompt's first token has none
    assert len(choice["logprobs"]["tokens"]) == echo["usage"]["prompt_tokens"] + echo["usage"]["completion_tokens"]


def test_grpc_client_gets_indexes_and_logprobs(services: Callable[..., ServiceProcess]) -> None:
    router = router_over(services)
    sampling = common_pb2.SamplingParams(max_tokens=3, ignore_eos=True, n=2, logprobs=1)
    req = router_pb2.RouterServiceGenerateRequest(
        token_ids=common_pb2.TokenIds(ids=list(range(3, 60))), sampling=sampling
    )

    async def run() -> list[router_pb2.RouterServiceGenerateResponse]:
        async with AsyncClient(routers=[router.address]) as client:
            return [m async for m in client.generate(req)]

    msgs = asyncio.run(run())
    per_index: dict[int, int] = {}
    for m in msgs:
        per_index[m.index] = per_index.get(m.index, 0) + len(m.token_ids)
        assert len(m.logprobs) == len(m.token_ids)
    assert per_index == {0: 3, 1: 3}
    assert {m.index for m in msgs if m.finish_reason} == {0, 1} and msgs[-1].usage.completion_tokens == 6
