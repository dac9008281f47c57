"""One table, both services: the router's and the worker's OpenAI endpoints answer the same HTTP status, OpenAI
error type and `param` for the same error (`kvmesh.openai.errors`, the one HTTP table).

Real processes on 127.0.0.1: a sim worker, a router in front of it (API keys on), a router with a one-request
rate limit and a worker with no waiting room (both answer 429). A refusal the worker's engine raises (the
simulated engine's of a structured output) names its field through the router as on the worker, over HTTP
(whole and streamed) and the router's gRPC API. Errors only an engine raises on a worker
(NotFound, Unauthenticated, ...) are checked on the worker's own HTTP app over a stub engine that raises them
(before the one table the worker answered 500 for those), against the router's answer to the request that
raises the same class there (an unknown model, a bad or missing API key).
"""

from __future__ import annotations

from collections.abc import AsyncGenerator, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import grpc
import httpx
import pytest
from aiohttp import web
from aiohttp.test_utils import TestClient, TestServer

from kvmesh.core import errors
from kvmesh.core.generation import EngineOutput, EngineRequest
from kvmesh.rpc.errors import bad_request_fields
from kvmesh.services.worker.openai_http import OpenAIApi
from kvmesh.suite.launcher import ServiceProcess, start_service
from kvmesh.v1 import common_pb2, router_pb2, router_pb2_grpc
from tests.support.sim_worker import BS, start_sim_worker

pytestmark = pytest.mark.integration
KEY = "k-openai-errors"
AUTH = {"Authorization": f"Bearer {KEY}"}
CHAT = [{"role": "user", "content": "hi"}]


@dataclass(frozen=True)
class Case:
    """A request and the answer both services must give."""

    path: str
    status: int
    etype: str
    param: str | None = None
    body: dict[str, Any] | None = None
    raw: bytes | None = None  # sent as is instead of `body`
    headers: dict[str, str] = field(default_factory=lambda: dict(AUTH))


def bad(param: str, body: dict[str, Any] | None = None, raw: bytes | None = None, chat: bool = False) -> Case:
    """A 400 invalid_request_error naming `param`."""
    path = "/v1/chat/completions" if chat else "/v1/completions"
    return Case(path, 400, "invalid_request_error", param, body, raw)


BOTH = {
    "malformed-json": bad("body", raw=b'{"prompt": '),
    "body-not-object": bad("body", raw=b"[1, 2]"),
    "no-prompt": bad("prompt", {"max_tokens": 2}),
    "prompt-bad-ids": bad("prompt", {"prompt": [1, -5]}),
    # vLLM's cap: router HTTP refused 2.5 but the worker served it (its cap was the engine's: none)
    "temperature-over-2": bad("temperature", {"prompt": [5, 6], "temperature": 2.5}),
    "temperature-type": bad("temperature", {"prompt": [5], "temperature": "hot"}),
    "top-p-over-1": bad("top_p", {"prompt": [5], "top_p": 7}),
    "top-k-under-minus-1": bad("top_k", {"prompt": [5], "top_k": -3}),
    "max-tokens-0": bad("max_tokens", {"prompt": [5], "max_tokens": 0}),
    "max-tokens-over-limit": bad("max_tokens", {"prompt": [5], "max_tokens": 9000}),
    "stop-type": bad("stop", {"prompt": [5], "stop": 5}),
    "n-0": bad("n", {"prompt": [5], "n": 0}),
    "seed-negative": bad("seed", {"prompt": [5], "seed": -1}),
    "stream-bad-field": bad("top_p", {"prompt": [5], "top_p": 0, "stream": True}),
    "chat-no-messages": bad("messages", {"messages": "nope"}, chat=True),
    "chat-bad-content": bad("messages[0].content", {"messages": [{"role": "user", "content": 1}]}, chat=True),
    "chat-temperature": bad("temperature", {"messages": CHAT, "temperature": 3}, chat=True),
    # the input-hardening work: inputs that ended in a 500 (traceback) or were silently ignored with a 200
    "prompt-lone-surrogate": bad("prompt", raw=b'{"prompt": "\\ud800", "max_tokens": 2}'),
    "chat-lone-surrogate": bad(
        "messages[0].content", raw=b'{"messages": [{"role": "user", "content": "a\\ud800"}]}', chat=True
    ),
    "json-nested-100000-deep": bad("body", raw=b'{"prompt": ' + b"[" * 100_000 + b"]" * 100_000 + b"}"),
    "prompt-booleans": bad("prompt", {"prompt": [True, False]}),
    "stop-token-ids-booleans": bad("stop_token_ids", {"prompt": [5], "stop_token_ids": [True, False]}),
    "n-17": bad("n", {"prompt": [5], "n": 17}),  # above kvmesh's bound
    "best-of": bad("best_of", {"prompt": [5], "best_of": 3}),
    "logprobs": bad("logprobs", {"prompt": [5], "logprobs": 21}),  # above vLLM's max_logprobs
    "chat-logprobs": bad("logprobs", {"messages": CHAT, "logprobs": 2}, chat=True),  # a boolean in chat
    "chat-top-logprobs": bad("top_logprobs", {"messages": CHAT, "top_logprobs": 3}, chat=True),
    "echo": bad("echo", {"prompt": [5], "echo": "yes"}),
    "suffix": bad("suffix", {"prompt": [5], "suffix": "x"}),
    "logit-bias-malformed": bad("logit_bias", {"prompt": [5], "logit_bias": [1, 2]}),
    "logit-bias-key": bad("logit_bias", {"prompt": [5], "logit_bias": {"five": 10}}),
    "unknown-field": bad("frobnicate", {"prompt": [5], "frobnicate": 1}),
    "chat-field-on-completions": bad("messages", {"prompt": [5], "messages": CHAT}),
    # a refusal the (simulated) worker's engine raises names its field on the router too, across the gRPC hop
    "sim-refuses-structured-outputs": bad("structured_outputs", {"prompt": [5], "structured_outputs": {"regex": "a+"}}),
    "sim-refuses-response-format-streamed": bad(
        "structured_outputs", {"prompt": [5], "response_format": {"type": "json_object"}, "stream": True}
    ),
    "chat-sim-refuses-response-format": bad(
        "structured_outputs", {"messages": CHAT, "response_format": {"type": "json_object"}}, chat=True
    ),
}
OFF_VALUES = {"n": 1, "best_of": 1, "logprobs": None, "echo": False, "suffix": None, "logit_bias": {}}

# Errors a router raises itself, and the domain class a worker's engine would raise for the same case.
ENGINE_RAISED = {
    "unknown-model": (
        Case("/v1/completions", 404, "not_found_error", body={"model": "no-such-model", "prompt": [5]}),
        errors.NotFound("unknown model 'no-such-model'"),
    ),
    "bad-api-key": (
        Case("/v1/completions", 401, "authentication_error", body={"prompt": [5]}, headers={"X-Api-Key": "x"}),
        errors.Unauthenticated("unknown API key"),
    ),
    "missing-api-key": (
        Case("/v1/chat/completions", 401, "authentication_error", body={"messages": CHAT}, headers={}),
        errors.Unauthenticated("missing API key"),
    ),
}


def post(sp: ServiceProcess, case: Case) -> httpx.Response:
    url = f"http://127.0.0.1:{sp.http_port}{case.path}"
    if case.raw is not None:
        return httpx.post(url, content=case.raw, headers=case.headers, timeout=30)
    return httpx.post(url, json=case.body, headers=case.headers, timeout=30)


def check(status: int, headers: Any, body: Any, case: Case) -> None:
    """The answer is the case's, in OpenAI's error shape."""
    assert status == case.status, body
    err = body["error"]
    assert set(err) == {"message", "type", "param", "code"} and err["message"]
    assert (err["type"], err["param"], err["code"]) == (case.etype, case.param, case.status)
    assert ("Retry-After" in headers) == (case.status == 429)


@pytest.fixture(scope="module")
def keyfile(tmp_path_factory: pytest.TempPathFactory) -> str:
    path = tmp_path_factory.mktemp("keys") / "keys.txt"
    path.write_text(KEY + "\n")
    return str(path)


def _start(name: str, tmp: Path, *flags: str) -> Iterator[ServiceProcess]:
    sp = start_service(name, tmp, *flags, timeout=60)
    yield sp
    assert sp.terminate(timeout=30) == 0


@pytest.fixture(scope="module")
def router(
    tmp_path_factory: pytest.TempPathFactory, sim_worker: ServiceProcess, keyfile: str
) -> Iterator[ServiceProcess]:
    flags = ("--workers", sim_worker.address, "--block-size", str(BS), "--api-keys-file", keyfile)
    yield from _start("router", tmp_path_factory.mktemp("r"), *flags)


@pytest.fixture(scope="module")
def limited_router(tmp_path_factory: pytest.TempPathFactory, sim_worker: ServiceProcess) -> Iterator[ServiceProcess]:
    """One request per ~17 minutes: the second request is refused."""
    flags = ("--workers", sim_worker.address, "--block-size", str(BS), "--rate-limit-rps", "0.001")
    yield from _start("router", tmp_path_factory.mktemp("rl"), *flags, "--rate-limit-burst", "1")


@pytest.fixture(scope="module")
def full_worker(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServiceProcess]:
    """A worker with no waiting room: every generation request is refused."""
    sp = start_sim_worker(tmp_path_factory.mktemp("wf"), "--max-queue", "0")
    yield sp
    assert sp.terminate(timeout=30) == 0


@pytest.mark.parametrize("case", list(BOTH.values()), ids=list(BOTH))
def test_router_and_worker_answer_alike(case: Case, router: ServiceProcess, sim_worker: ServiceProcess) -> None:
    answers = [post(sp, case) for sp in (router, sim_worker)]
    for r in answers:
        check(r.status_code, r.headers, r.json(), case)


def test_both_keep_serving_after_errors(router: ServiceProcess, sim_worker: ServiceProcess) -> None:
    ok = Case("/v1/completions", 200, "", body={"prompt": [5, 6, 7], "max_tokens": 2, "temperature": 2.0})
    for sp in (router, sim_worker):
        r = post(sp, ok)
        assert r.status_code == 200, r.text
        assert r.json()["usage"]["completion_tokens"] == 2


def test_unsupported_fields_with_their_off_values_are_served(
    router: ServiceProcess, sim_worker: ServiceProcess
) -> None:
    """`n: 1`, `echo: false`, `logit_bias: {}` ... mean "off": accepted (clients send them by default)."""
    ok = Case("/v1/completions", 200, "", body={"prompt": [5, 6], "max_tokens": 2, "logprobs": 0, **OFF_VALUES})
    for sp in (router, sim_worker):
        r = post(sp, ok)
        assert r.status_code == 200, r.text
        assert r.json()["usage"]["completion_tokens"] == 2
    assert "Traceback" not in router.log() + sim_worker.log()


def test_rate_limited_alike(limited_router: ServiceProcess, full_worker: ServiceProcess) -> None:
    """429 rate_limit_error with Retry-After from both (the worker's type was 'rate_limit_exceeded')."""
    case = Case("/v1/completions", 429, "rate_limit_error", body={"prompt": [5, 6], "max_tokens": 2})
    assert post(limited_router, case).status_code == 200  # the bucket's one token
    for sp in (limited_router, full_worker):
        r = post(sp, case)
        check(r.status_code, r.headers, r.json(), case)
        assert int(r.headers["Retry-After"]) >= 1


class RaisingEngine:
    """An engine whose every request fails with `exc` before its first output."""

    def __init__(self, exc: Exception) -> None:
        self.exc = exc

    async def generate(self, req: EngineRequest) -> AsyncGenerator[EngineOutput, None]:
        raise self.exc
        yield EngineOutput(req.request_id)  # pragma: no cover - makes this an async generator


@pytest.mark.parametrize(("case", "exc"), list(ENGINE_RAISED.values()), ids=list(ENGINE_RAISED))
async def test_engine_raised_errors_alike(case: Case, exc: Exception, router: ServiceProcess) -> None:
    r = post(router, case)
    check(r.status_code, r.headers, r.json(), case)
    app = web.Application()
    OpenAIApi(RaisingEngine(exc), "m").add_routes(app)  # type: ignore[arg-type]
    async with TestClient(TestServer(app, host="127.0.0.1", port=0)) as client:
        for stream in (False, True):
            body = dict(case.body or {}) | {"stream": stream}
            got = await client.post(case.path, json=body, headers=case.headers)
            check(got.status, got.headers, await got.json(), case)


async def test_a_worker_refusal_names_its_field_over_the_routers_grpc_api(router: ServiceProcess) -> None:
    sampling = common_pb2.SamplingParams(max_tokens=2, structured_output=common_pb2.StructuredOutput(regex="a+"))
    req = router_pb2.RouterServiceGenerateRequest(token_ids=common_pb2.TokenIds(ids=[5, 6]), sampling=sampling)
    async with grpc.aio.insecure_channel(router.address) as ch:
        call = router_pb2_grpc.RouterServiceStub(ch).Generate(req, metadata=(("authorization", f"Bearer {KEY}"),))
        with pytest.raises(grpc.aio.AioRpcError) as ei:
            async for _ in call:
                pass
    assert ei.value.code() is grpc.StatusCode.INVALID_ARGUMENT
    assert bad_request_fields(ei.value) == ["structured_outputs"], ei.value.details()
