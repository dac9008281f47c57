"""Router end to end with simulated workers (real processes on 127.0.0.1): per-tenant and per-LoRA block-hash
salting and client-side resume (`resume_token_ids`).

Tenant salting: the cache-manager salts a chain's first block with `make_salt(model, lora, tenant)`, and so does
the router, both with their default salt model (''): tenant B's request for the prompt tenant A has cached gets
no cached-prefix credit, neither in the router's decision (`kvmesh_router_cached_tokens_total` unchanged)
nor on the worker (`usage.cached_tokens == 0`); tenant A's repeat gets both.

Resume: with a fixed seed the simulated engine's token at position p depends on (seed, p) only, so a request
resumed after the first k tokens of a full run must stream exactly the rest of that run.
"""

from __future__ import annotations

import re
import time
from collections.abc import Callable
from functools import partial

import grpc
import httpx
import pytest

from kvmesh.suite.launcher import ServiceProcess
from kvmesh.v1 import common_pb2, router_pb2, router_pb2_grpc
from tests.support.procs import start_together

pytestmark = pytest.mark.integration
BS = 32


def toks(n: int, start: int = 0) -> list[int]:
    return [(start + i) % 1000 + 3 for i in range(n)]


def run(address: str, req: router_pb2.RouterServiceGenerateRequest) -> list[router_pb2.RouterServiceGenerateResponse]:
    with grpc.insecure_channel(address) as ch:
        return list(router_pb2_grpc.RouterServiceStub(ch).Generate(req, timeout=30))


def gen(ids: list[int], max_tokens: int, **kw: object) -> router_pb2.RouterServiceGenerateRequest:
    return router_pb2.RouterServiceGenerateRequest(
        token_ids=common_pb2.TokenIds(ids=ids),
        sampling=common_pb2.SamplingParams(max_tokens=max_tokens, ignore_eos=True, seed=7),
        **kw,  # type: ignore[arg-type]
    )


def routed_cached_tokens(router: ServiceProcess) -> float:
    """The router's own count of cached prompt tokens it credited to its choices (its index view)."""
    text = httpx.get(f"http://127.0.0.1:{router.http_port}/metrics", timeout=10).text
    m = re.search(r"^kvmesh_router_cached_tokens_total (\S+)$", text, re.M)
    return float(m.group(1)) if m else 0.0


def salted_suite(services: Callable[..., ServiceProcess], *router_flags: str) -> ServiceProcess:
    """A cache-manager, 2 instant sim workers feeding it, and a router following its index; returns the router."""
    cm = services("cache-manager", "--block-size", str(BS))
    workers = [
        services(
            "worker",
            "--engine",
            "sim",
            "--sim-speed",
            "0",
            "--block-size",
            str(BS),
            "--kv-blocks",
            "4096",
            "--cache-manager",
            cm.address,
        )
        for _ in range(2)
    ]
    return services(
        "router",
        "--workers",
        ",".join(w.address for w in workers),
        "--block-size",
        str(BS),
        "--cache-manager",
        cm.address,
        *router_flags,
    )


def repeat_until_credited(
    router: ServiceProcess, req: router_pb2.RouterServiceGenerateRequest, min_tokens: int, timeout_s: float = 20
) -> router_pb2.RouterServiceGenerateResponse | None:
    """Repeats `req` until the router credits it with ≥ `min_tokens` cached tokens (the first request's blocks
    reach the router's replica via worker → cache-manager → watch); the last response, None on timeout."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        before = routed_cached_tokens(router)
        last = run(router.address, req)[-1]
        if routed_cached_tokens(router) - before >= min_tokens:
            return last
    return None


def test_tenant_b_gets_no_credit_for_tenant_a_blocks(services: Callable[..., ServiceProcess]) -> None:
    router = salted_suite(services)  # default salt model '' on both sides
    prompt = toks(10 * BS, 42)
    first = run(router.address, gen(prompt, 2, tenant="A"))
    home = first[-1].worker_id
    assert first[-1].usage.cached_tokens == 0

    last = repeat_until_credited(router, gen(prompt, 2, tenant="A"), 9 * BS)
    assert last is not None, "tenant A's repeat never got cached-prefix credit from the router"
    assert last.worker_id == home and last.usage.cached_tokens >= 9 * BS

    before = routed_cached_tokens(router)
    b = run(router.address, gen(prompt, 2, tenant="B"))[-1]
    assert routed_cached_tokens(router) - before == 0, "router credited tenant B with tenant A's blocks"
    assert b.usage.cached_tokens == 0

    before = routed_cached_tokens(router)
    a2 = run(router.address, gen(prompt, 2, tenant="A"))[-1]
    assert routed_cached_tokens(router) - before >= 9 * BS
    assert a2.worker_id == home and a2.usage.cached_tokens >= 9 * BS


def test_lora_adapters_are_selected_salted_and_validated(services: Callable[..., ServiceProcess]) -> None:
    """A LoRA adapter (gRPC `lora_name` or the HTTP body's "model") salts the block hashes like a tenant: the
    adapter's repeat is credited and served from cache, the base model's request for the same prompt is not;
    an unknown adapter or model is NOT_FOUND / HTTP 404 and the router keeps serving."""
    router = salted_suite(services, "--lora-adapters", "sql-lora,chat-lora")
    http = f"http://127.0.0.1:{router.http_port}"
    listed = httpx.get(f"{http}/v1/models", timeout=10).json()["data"]
    base_name = listed[0]["id"]
    models = {m["id"]: m.get("parent") for m in listed}
    assert models == {base_name: None, "sql-lora": base_name, "chat-lora": base_name}

    prompt = toks(10 * BS, 77)
    first = run(router.address, gen(prompt, 2, lora_name="sql-lora"))[-1]
    assert first.usage.cached_tokens == 0
    last = repeat_until_credited(router, gen(prompt, 2, lora_name="sql-lora"), 9 * BS)
    assert last is not None, "the adapter's repeat never got cached-prefix credit"
    assert last.usage.cached_tokens >= 9 * BS

    before = routed_cached_tokens(router)
    base = run(router.address, gen(prompt, 2))[-1]
    assert routed_cached_tokens(router) - before == 0 and base.usage.cached_tokens == 0
    other = run(router.address, gen(prompt, 2, lora_name="chat-lora"))[-1]
    assert other.usage.cached_tokens == 0, "another adapter was served sql-lora's KV blocks"

    # HTTP: "model" names the adapter (the vLLM convention) and is echoed back
    r = httpx.post(
        f"{http}/v1/completions",
        timeout=30,
        json={"model": "sql-lora", "prompt": prompt, "max_tokens": 2, "ignore_eos": True},
    )
    assert r.status_code == 200, r.text
    assert r.json()["model"] == "sql-lora" and r.json()["usage"]["prompt_tokens_details"]["cached_tokens"] >= 9 * BS

    with pytest.raises(grpc.RpcError) as err:
        run(router.address, gen(prompt, 2, lora_name="no-such-lora"))
    assert err.value.code() == grpc.StatusCode.NOT_FOUND and "no-such-lora" in (err.value.details() or "")
    r = httpx.post(f"{http}/v1/completions", timeout=30, json={"model": "gpt-4", "prompt": prompt, "max_tokens": 2})
    assert r.status_code == 404 and r.json()["error"]["type"] == "not_found_error"
    assert run(router.address, gen(prompt, 2, lora_name="sql-lora"))[-1].usage.cached_tokens >= 9 * BS


def test_resume_token_ids_continue_the_stream(services: Callable[..., ServiceProcess]) -> None:
    workers = start_together(
        *[partial(services, "worker", "--engine", "sim", "--sim-speed", "0", "--block-size", str(BS))] * 2
    )
    router = services("router", "--workers", ",".join(w.address for w in workers), "--block-size", str(BS))
    prompt = toks(3 * BS + 5, 9)
    full_msgs = run(router.address, gen(prompt, 12))
    full = [t for m in full_msgs for t in m.token_ids]
    assert len(full) == 12

    k = 5
    msgs = run(router.address, gen(prompt, 12, resume_token_ids=full[:k]))
    new = [t for m in msgs for t in m.token_ids]
    assert new[0] == full[k]  # the first new token follows the resumed ones
    assert new == full[k:]
    assert msgs[-1].finish_reason == common_pb2.FINISH_REASON_LENGTH
    u = msgs[-1].usage
    # resumed + new = max_tokens; usage counts only the generated ones (input hardening: resumed ids are the client's)
    assert u.prompt_tokens == len(prompt) and u.completion_tokens == 12 - k

    done = run(router.address, gen(prompt, 12, resume_token_ids=full))  # nothing left to generate
    assert [t for m in done for t in m.token_ids] == []
    assert done[-1].finish_reason == common_pb2.FINISH_REASON_LENGTH and done[-1].usage.completion_tokens == 0
