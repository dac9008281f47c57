"""Signed requests and tenants bound to API keys, against a real router (real processes on 127.0.0.1: a
cache-manager, one instant sim worker feeding it, a router following its index) with a YAML keys file.

Signing (kvmesh.security.signing), over gRPC and HTTP: a signed request passes; the same request again is a
replay; its signature with a timestamp outside the window, or over a body one byte different, is refused; a
key that requires signing refuses an unsigned request; kvmesh.client signs its calls itself.

Tenants (the cache side channel of the security review): bob's key may use tenant "bob" only. Alice's prompt is cached
under tenant "alice"; bob declaring tenant=alice is refused (PERMISSION_DENIED / 403 naming the tenant), and
bob declaring nothing runs as "bob": no cached-prefix credit in the router's decision nor in `cached_tokens`,
while alice's own repeat gets both (the control that shows the probe would have seen her cache).
"""

from __future__ import annotations

import asyncio
import base64
import json
import re
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import grpc
import httpx
import pytest

from kvmesh.client import AsyncClient
from kvmesh.security.signing import sign
from kvmesh.suite.launcher import ServiceProcess, start_service
from kvmesh.v1 import common_pb2, router_pb2, router_pb2_grpc

pytestmark = pytest.mark.integration
BS = 32
GENERATE = "/kvmesh.v1.RouterService/Generate"
KEYS = """
- {key: sk-alice, id: alice, tenants: [alice]}
- {key: sk-bob, id: bob, tenants: [bob]}
- {key: sk-signer, id: signer, signing_secret: signer-secret, require_signature: true, role: admin}
- {key: sk-ops, id: ops, role: admin}
"""
SECRET = "signer-secret"


def _start(name: str, tmp: Path, *flags: str) -> Iterator[ServiceProcess]:
    sp = start_service(name, tmp, *flags, timeout=60)
    yield sp
    assert sp.terminate(timeout=30) == 0


@pytest.fixture(scope="module")
def cache_manager(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServiceProcess]:
    yield from _start("cache-manager", tmp_path_factory.mktemp("cm"), "--block-size", str(BS))


@pytest.fixture(scope="module")
def worker(tmp_path_factory: pytest.TempPathFactory, cache_manager: ServiceProcess) -> Iterator[ServiceProcess]:
    flags = ("--engine", "sim", "--sim-speed", "0", "--block-size", str(BS), "--kv-blocks", "4096")
    yield from _start("worker", tmp_path_factory.mktemp("w"), *flags, "--cache-manager", cache_manager.address)


@pytest.fixture(scope="module")
def router(
    tmp_path_factory: pytest.TempPathFactory, worker: ServiceProcess, cache_manager: ServiceProcess
) -> Iterator[ServiceProcess]:
    keys = tmp_path_factory.mktemp("keys") / "keys.yaml"
    keys.write_text(KEYS)
    flags = ("--workers", worker.address, "--block-size", str(BS), "--cache-manager", cache_manager.address)
    yield from _start("router", tmp_path_factory.mktemp("r"), *flags, "--api-keys-file", str(keys))


def toks(n: int, start: int = 0) -> list[int]:
    return [(start + i) % 1000 + 3 for i in range(n)]


def gen_bytes(ids: list[int], max_tokens: int = 2, **kw: object) -> bytes:
    return router_pb2.RouterServiceGenerateRequest(
        token_ids=common_pb2.TokenIds(ids=ids),
        sampling=common_pb2.SamplingParams(max_tokens=max_tokens, ignore_eos=True, seed=7),
        **kw,  # type: ignore[arg-type]
    ).SerializeToString()


def call(
    router: ServiceProcess, body: bytes, key: str, sig: str | None = None, ts: int | None = None
) -> list[router_pb2.RouterServiceGenerateResponse]:
    """Generate with exactly `body` on the wire, the key and (when given) the signing metadata."""
    md = [("authorization", f"Bearer {key}")]
    md += [("x-kvmesh-signature", sig)] if sig is not None else []
    md += [("x-kvmesh-timestamp", str(ts))] if ts is not None else []
    with grpc.insecure_channel(router.address) as ch:
        rpc = ch.unary_stream(GENERATE, response_deserializer=router_pb2.RouterServiceGenerateResponse.FromString)
        return list(rpc(body, metadata=md, timeout=30))


def refused(fn: Callable[[], object]) -> grpc.RpcError:
    with pytest.raises(grpc.RpcError) as ei:
        fn()
    return ei.value


def one_byte_apart(ids: list[int]) -> tuple[bytes, bytes]:
    """Two Generate bodies that differ in exactly one byte (the last token id, 5 vs 6)."""
    a, b = gen_bytes([*ids, 5]), gen_bytes([*ids, 6])
    assert len(a) == len(b) and sum(x != y for x, y in zip(a, b, strict=True)) == 1
    return a, b


def test_grpc_signed_requests(router: ServiceProcess) -> None:
    now = int(time.time())
    body, tampered = one_byte_apart(toks(40))
    sig = sign(SECRET, "POST", GENERATE, body, now)
    msgs = call(router, body, "sk-signer", sig, now)
    assert sum(len(m.token_ids) for m in msgs) == 2 and msgs[-1].finish_reason == common_pb2.FINISH_REASON_LENGTH

    cases = {
        "replayed": lambda: call(router, body, "sk-signer", sig, now),
        "signature does not match": lambda: call(router, tampered, "sk-signer", sig, now),
        r"outside the replay window \(±300 s\)": lambda: call(
            router, body, "sk-signer", sign(SECRET, "POST", GENERATE, body, now - 301), now - 301
        ),
        "'signer' requires a signed request: missing X-Kvmesh-Signature and X-Kvmesh-Timestamp": lambda: call(
            router, body, "sk-signer"
        ),
        "missing X-Kvmesh-Timestamp": lambda: call(router, body, "sk-signer", sig),
    }
    for message, fn in cases.items():
        e = refused(fn)
        assert e.code() == grpc.StatusCode.UNAUTHENTICATED and re.search(message, e.details() or ""), e.details()
    # base64 is accepted as well as hex; a key without a secret refuses signing it cannot check
    other = gen_bytes(toks(40, 1))
    as_b64 = base64.b64encode(bytes.fromhex(sign(SECRET, "POST", GENERATE, other, now))).decode()
    assert call(router, other, "sk-signer", as_b64, now)[-1].finish_reason == common_pb2.FINISH_REASON_LENGTH
    e = refused(lambda: call(router, body, "sk-bob", sig, now))
    assert e.code() == grpc.StatusCode.UNAUTHENTICATED and "no signing secret" in (e.details() or "")


def test_grpc_admin_calls_are_signed_over_the_message(router: ServiceProcess) -> None:
    path, now = "/kvmesh.v1.RouterAdminService/DrainWorker", int(time.time())
    with grpc.insecure_channel(router.address) as ch:
        admin = router_pb2_grpc.RouterAdminServiceStub(ch)
        e = refused(lambda: admin.ListWorkers(router_pb2.ListWorkersRequest(), metadata=[("x-api-key", "sk-alice")]))
        assert e.code() == grpc.StatusCode.PERMISSION_DENIED and "role client" in (e.details() or "")
        wid = admin.ListWorkers(router_pb2.ListWorkersRequest(), metadata=[("x-api-key", "sk-ops")]).workers[0]
        req = router_pb2.DrainWorkerRequest(worker_id=wid.endpoint.id, drain=False)
        md = [("x-api-key", "sk-signer"), ("x-kvmesh-timestamp", str(now))]
        sig = ("x-kvmesh-signature", sign(SECRET, "POST", path, req.SerializeToString(), now))
        assert admin.DrainWorker(req, metadata=[*md, sig]).in_flight == 0
        other = router_pb2.DrainWorkerRequest(worker_id=wid.endpoint.id, drain=True)  # not what was signed
        e = refused(lambda: admin.DrainWorker(other, metadata=[*md, sig]))
        assert e.code() == grpc.StatusCode.UNAUTHENTICATED and "does not match" in (e.details() or "")
        e = refused(lambda: admin.DrainWorker(other, metadata=[("x-api-key", "sk-signer")]))
        assert e.code() == grpc.StatusCode.UNAUTHENTICATED and "requires a signed request" in (e.details() or "")
        listed = admin.ListWorkers(router_pb2.ListWorkersRequest(), metadata=[("x-api-key", "sk-ops")])
        assert not listed.workers[0].draining  # the refused drain did nothing


def test_kvmesh_client_signs_its_calls(router: ServiceProcess) -> None:
    async def run(secret: str) -> int:
        async with AsyncClient(routers=[router.address], api_key="sk-signer", signing_secret=secret) as c:
            req = router_pb2.RouterServiceGenerateRequest.FromString(gen_bytes(toks(64, 9), max_tokens=3))
            return sum([len(m.token_ids) async for m in c.generate(req)])

    assert asyncio.run(run(SECRET)) == 3
    with pytest.raises(grpc.aio.AioRpcError) as ei:
        asyncio.run(run("wrong-secret"))
    assert ei.value.code() == grpc.StatusCode.UNAUTHENTICATED


def http_post(router: ServiceProcess, path: str, body: bytes, key: str, **headers: str) -> httpx.Response:
    h = {"Authorization": f"Bearer {key}", "Content-Type": "application/json", **headers}
    return httpx.post(f"http://127.0.0.1:{router.http_port}{path}", content=body, headers=h, timeout=30)


def signed_headers(path: str, body: bytes, ts: int, method: str = "POST") -> dict[str, str]:
    return {"X-Kvmesh-Signature": sign(SECRET, method, path, body, ts), "X-Kvmesh-Timestamp": str(ts)}


def test_http_signed_requests(router: ServiceProcess) -> None:
    path, now = "/v1/completions", int(time.time())
    body = b'{"prompt": [5, 6, 7], "max_tokens": 2, "ignore_eos": true}'
    tampered = body.replace(b"[5, 6, 7]", b"[5, 6, 8]")
    r = http_post(router, path, body, "sk-signer", **signed_headers(path, body, now))
    assert r.status_code == 200, r.text
    assert r.json()["usage"]["completion_tokens"] == 2
    cases = [
        (body, signed_headers(path, body, now), "replayed"),
        (tampered, signed_headers(path, body, now), "signature does not match"),
        (body, signed_headers(path, body, now - 301), "outside the replay window (±300 s)"),
        (body, signed_headers("/v1/chat/completions", body, now + 1), "signature does not match"),
        (body, {}, "requires a signed request: missing X-Kvmesh-Signature and X-Kvmesh-Timestamp"),
    ]
    for sent, headers, message in cases:
        r = http_post(router, path, sent, "sk-signer", **headers)
        assert r.status_code == 401 and message in r.json()["error"]["message"], r.text
        assert r.json()["error"]["type"] == "authentication_error"
    # a GET signs the empty body
    ts = int(time.time()) + 2
    get = httpx.get(
        f"http://127.0.0.1:{router.http_port}/v1/models",
        headers={"Authorization": "Bearer sk-signer", **signed_headers("/v1/models", b"", ts, "GET")},
        timeout=10,
    )
    assert get.status_code == 200, get.text
    # an admin route: the signature covers its JSON body
    workers = f"http://127.0.0.1:{router.http_port}/admin/workers"
    assert httpx.get(workers, headers={"X-Api-Key": "sk-alice"}).status_code == 403  # a client key is no admin
    wid = httpx.get(workers, headers={"X-Api-Key": "sk-ops"}).json()
    drain = json.dumps({"worker_id": wid["workers"][0]["endpoint"]["id"], "drain": False}).encode()
    r = http_post(router, "/admin/drain", drain, "sk-signer", **signed_headers("/admin/drain", drain, ts))
    assert r.status_code == 200 and r.json() == {"in_flight": 0}, r.text
    r = http_post(router, "/admin/drain", drain, "sk-signer")
    assert r.status_code == 401 and "requires a signed request" in r.json()["error"]["message"], r.text


def routed_cached_tokens(router: ServiceProcess) -> float:
    """The router's own count of cached prompt tokens it credited to its choices (its index view)."""
    text = httpx.get(f"http://127.0.0.1:{router.http_port}/metrics", timeout=10).text
    m = re.search(r"^kvmesh_router_cached_tokens_total (\S+)$", text, re.M)
    return float(m.group(1)) if m else 0.0


def credited(router: ServiceProcess, body: bytes, key: str) -> tuple[float, router_pb2.RouterServiceGenerateResponse]:
    """(cached tokens the router credited to this request, its last response)."""
    before = routed_cached_tokens(router)
    last = call(router, body, key)[-1]
    return routed_cached_tokens(router) - before, last


def test_cache_side_channel_is_closed(router: ServiceProcess) -> None:
    prompts = [toks(10 * BS, 500), toks(10 * BS, 700)]  # alice's; bob probes one over gRPC, one over HTTP
    for prompt in prompts:
        alice = gen_bytes(prompt)
        assert call(router, alice, "sk-alice")[-1].usage.cached_tokens == 0  # alice's prompt, now cached
        deadline = time.monotonic() + 20  # her blocks reach the router's replica via worker → cache-manager → watch
        while credited(router, alice, "sk-alice")[0] < 9 * BS:
            assert time.monotonic() < deadline, "alice's repeat never got cached-prefix credit from the router"

    # bob probes: declaring alice's tenant is refused, naming it
    e = refused(lambda: call(router, gen_bytes(prompts[0], tenant="alice"), "sk-bob"))
    assert e.code() == grpc.StatusCode.PERMISSION_DENIED and "tenant 'alice'" in (e.details() or "")
    body = json.dumps({"prompt": prompts[1], "max_tokens": 1}).encode()
    r = http_post(router, "/v1/completions", body, "sk-bob", **{"X-Kvmesh-Tenant": "alice"})
    assert r.status_code == 403 and "tenant 'alice'" in r.json()["error"]["message"], r.text
    # declaring nothing, bob runs as bob: no credit for alice's blocks, none in cached_tokens
    got, last = credited(router, gen_bytes(prompts[0]), "sk-bob")
    assert got == 0 and last.usage.cached_tokens == 0
    before = routed_cached_tokens(router)
    r = http_post(router, "/v1/completions", body, "sk-bob")
    assert r.status_code == 200 and r.json()["usage"]["prompt_tokens_details"]["cached_tokens"] == 0, r.text
    assert routed_cached_tokens(router) == before
    # control: alice (by default, or declaring her own tenant) still gets her cache, over gRPC and HTTP
    got, last = credited(router, gen_bytes(prompts[0], tenant="alice"), "sk-alice")
    assert got >= 9 * BS and last.usage.cached_tokens >= 9 * BS
    r = http_post(router, "/v1/completions", body, "sk-alice")
    assert r.status_code == 200 and r.json()["usage"]["prompt_tokens_details"]["cached_tokens"] >= 9 * BS, r.text
