"""`n > 1`, log-probabilities, completions batches, echo and prompt log-probabilities through the router, over
sim workers: the HTTP API's OpenAI shapes (one choice per sequence of each prompt, usage over all of them,
vLLM's `prompt_logprobs`) and the gRPC stream's `index` / `logprobs` / `prompt_logprobs` through
`kvmesh.client`. Real router and simulated worker processes on loopback."""

from __future__ import annotations

import asyncio
import json
from collections.abc import Callable
from functools import partial
from typing import Any

import httpx
import pytest

from kvmesh.client.aio import AsyncClient
from kvmesh.suite.launcher import ServiceProcess
from kvmesh.v1 import common_pb2, router_pb2
from tests.support.procs import start_together

pytestmark = pytest.mark.integration
SIM = ("--engine", "sim", "--block-size", "32", "--kv-blocks", "1024", "--sim-speed", "0")


def router_over(services: Callable[..., ServiceProcess], n_workers: int = 2) -> ServiceProcess:
    workers = start_together(*[partial(services, "worker", *SIM)] * n_workers)
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


def valid_prompt_logprobs(plp: list[Any], n_prompt: int, k: int) -> bool:
    """vLLM's shape: one per prompt token, null first, then {id: {logprob, rank, decoded_token}}: the prompt's
    token and up to `k` alternatives."""
    entry = {"logprob", "rank", "decoded_token"}
    return (
        len(plp) == n_prompt
        and plp[0] is None
        and all(1 <= len(p) <= k + 1 and all(k_.isdigit() and set(v) == entry for k_, v in p.items()) for p in plp[1:])
    )


def test_http_echo_and_prompt_logprobs(services: Callable[..., ServiceProcess]) -> None:
    router = router_over(services, 1)
    echo = post(router, "/v1/completions", {"prompt": "echo me", "max_tokens": 2, "echo": True, "logprobs": 1})
    choice = echo["choices"][0]
    assert choice["text"].startswith("echo me")
    assert choice["logprobs"]["token_logprobs"][0] is None  # the prompt's first token has none
    assert len(choice["logprobs"]["tokens"]) == echo["usage"]["prompt_tokens"] + echo["usage"]["completion_tokens"]
    # echo with logprobs asks for the prompt's (as vLLM), so the choice carries them in vLLM's shape too
    assert valid_prompt_logprobs(choice["prompt_logprobs"], echo["usage"]["prompt_tokens"], 1)
    batch = {"prompt": ["a b c", "d e f g"], "max_tokens": 2, "n": 2, "prompt_logprobs": 2}
    out = post(router, "/v1/completions", batch)
    sizes = [len(post(router, "/tokenize", {"prompt": p})["tokens"]) for p in batch["prompt"]]
    assert [c["index"] for c in out["choices"]] == [0, 1, 2, 3]
    assert all(valid_prompt_logprobs(c["prompt_logprobs"], sizes[c["index"] // 2], 2) for c in out["choices"])
    chat = post(router, "/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2,
                                                   "prompt_logprobs": 0})  # fmt: skip
    assert valid_prompt_logprobs(chat["prompt_logprobs"], chat["usage"]["prompt_tokens"], 0)
    assert (
        "prompt_logprobs" not in chat["choices"][0]
        and "prompt_logprobs" not in post(router, "/v1/completions", {"prompt": "a", "max_tokens": 1})["choices"][0]
    )  # not asked for: no key
    r = httpx.post(f"http://127.0.0.1:{router.http_port}/v1/completions", timeout=30,
                   json={"prompt": "a", "max_tokens": 1, "stream": True, "prompt_logprobs": 1})  # fmt: skip
    assert (r.status_code, r.json()["error"]["param"]) == (400, "prompt_logprobs")  # as vLLM
    assert events(router, "/v1/completions", {"prompt": "a", "max_tokens": 1, "prompt_logprobs": 0})  # 0: served


def test_grpc_client_gets_indexes_and_logprobs(services: Callable[..., ServiceProcess]) -> None:
    router = router_over(services)
    sampling = common_pb2.SamplingParams(max_tokens=3, ignore_eos=True, n=2, logprobs=1, prompt_logprobs=1)
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
    with_prompt = [m.prompt_logprobs for m in msgs if m.prompt_logprobs]  # once, on the first step
    assert len(with_prompt) == 1 and len(with_prompt[0]) == 57 and not with_prompt[0][0].HasField("token")
