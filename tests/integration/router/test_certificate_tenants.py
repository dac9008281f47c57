"""Tenants bound to mTLS client certificates, against a real suite over mTLS (real processes on 127.0.0.1: a
cache-manager, one instant sim worker, a router; every connection with a certificate from `kvmesh certs`'s
development CA and the authorisation table enforced).

The router's keys file names bob's certificate (tenant "bob") and carol's (tenants "carol" and "shared"); alice's
certificate is named by no entry, so she is her own tenant ("alice"). Alice's prompt is cached under "alice";
bob declaring tenant=alice is refused (PERMISSION_DENIED naming the tenant), bob declaring nothing runs as "bob"
and gets no `cached_tokens` for her prompt, while alice's own repeat gets them (the control that shows the probe
would have seen her cache). Carol may choose "shared"; a keys entry that gives a certificate a signing secret
or a service role is an error naming the entry and the field (tests/unit/security/test_client_keys.py).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator

import grpc
import pytest

from kvmesh.security.certs import DevPki, make_dev_pki
from kvmesh.security.identity import CallerRole, Identity
from kvmesh.suite.launcher import ServiceProcess, start_service
from kvmesh.v1 import common_pb2, router_pb2, router_pb2_grpc

pytestmark = pytest.mark.integration
BS = 32
R = CallerRole
IDS = {
    "cache-manager": Identity(R.CACHE_MANAGER, "cm-cert"),
    "worker": Identity(R.WORKER, "worker-cert-0"),
    "router": Identity(R.ROUTER, "router-cert"),
    **{name: Identity(R.CLIENT, name) for name in ("alice", "bob", "carol")},
}
KEYS = """
- {certificate: "spiffe://kvmesh/-/client/bob", tenants: [bob]}
- {certificate: "spiffe://kvmesh/-/client/carol", tenants: [carol, shared]}
"""


def creds(pki: DevPki, name: str) -> grpc.ChannelCredentials:
    pair = pki.pairs[IDS[name]]
    return grpc.ssl_channel_credentials(pki.ca.read_bytes(), pair.key.read_bytes(), pair.cert.read_bytes())


def tls_flags(pki: DevPki, name: str) -> list[str]:
    pair, ca = pki.pairs[IDS[name]], str(pki.ca)
    cert, key = str(pair.cert), str(pair.key)
    return [
        *("--auth-mode", "enforce", "--tls-cert", cert, "--tls-key", key, "--tls-client-ca", ca, "--tls-ca", ca),
        *("--tls-client-cert", cert, "--tls-client-key", key),
    ]


@pytest.fixture(scope="module")
def pki(tmp_path_factory: pytest.TempPathFactory) -> DevPki:
    return make_dev_pki(tmp_path_factory.mktemp("pki"), list(IDS.values()))


@pytest.fixture(scope="module")
def router(tmp_path_factory: pytest.TempPathFactory, pki: DevPki) -> Iterator[ServiceProcess]:
    started: list[ServiceProcess] = []

    def start(name: str, *flags: str) -> ServiceProcess:
        d = tmp_path_factory.mktemp(name)
        sp = start_service(name, d, *flags, *tls_flags(pki, name), timeout=60, credentials=creds(pki, name))
        started.append(sp)
        return sp

    try:
        cm = start("cache-manager", "--block-size", str(BS))
        sim = ("--engine", "sim", "--sim-speed", "0", "--block-size", str(BS), "--kv-blocks", "4096")
        worker = start("worker", *sim, "--service-id", IDS["worker"].id, "--cache-manager", cm.address)
        keys = tmp_path_factory.mktemp("keys") / "keys.yaml"
        keys.write_text(KEYS)
        flags = ("--workers", worker.address, "--block-size", str(BS), "--cache-manager", cm.address)
        yield start("router", *flags, "--api-keys-file", str(keys))
    finally:
        for sp in reversed(started):
            assert sp.terminate(timeout=30) == 0


def generate(
    router: ServiceProcess, pki: DevPki, who: str, ids: list[int], tenant: str = ""
) -> router_pb2.RouterServiceGenerateResponse:
    """Generate as `who`'s certificate (no API key); the last response."""
    req = router_pb2.RouterServiceGenerateRequest(
        token_ids=common_pb2.TokenIds(ids=ids),
        sampling=common_pb2.SamplingParams(max_tokens=2, ignore_eos=True, seed=7),
        tenant=tenant,
    )
    with grpc.secure_channel(router.address, creds(pki, who)) as ch:
        return list(router_pb2_grpc.RouterServiceStub(ch).Generate(req, timeout=30))[-1]


def refused(fn: Callable[[], object]) -> grpc.RpcError:
    with pytest.raises(grpc.RpcError) as ei:
        fn()
    return ei.value


def test_a_certificate_is_bound_to_its_tenants(router: ServiceProcess, pki: DevPki) -> None:
    prompt = [(700 + i) % 1000 + 3 for i in range(10 * BS)]
    assert generate(router, pki, "alice", prompt).usage.cached_tokens == 0  # alice's prompt, now cached
    assert generate(router, pki, "alice", prompt, tenant="alice").usage.cached_tokens >= 9 * BS  # the control

    e = refused(lambda: generate(router, pki, "bob", prompt, tenant="alice"))
    assert e.code() == grpc.StatusCode.PERMISSION_DENIED, e
    assert "tenant 'alice' is not allowed for client 'bob' (allowed: bob)" in (e.details() or "")
    assert generate(router, pki, "bob", prompt).usage.cached_tokens == 0  # runs as bob: alice's cache unseen

    e = refused(lambda: generate(router, pki, "alice", prompt, tenant="bob"))  # unnamed: her own tenant only
    assert e.code() == grpc.StatusCode.PERMISSION_DENIED and "(allowed: alice)" in (e.details() or "")

    assert generate(router, pki, "carol", prompt, tenant="shared").usage.cached_tokens == 0
    assert generate(router, pki, "carol", prompt, tenant="shared").usage.cached_tokens >= 9 * BS
    assert generate(router, pki, "carol", prompt).usage.cached_tokens == 0  # her default, "carol", is apart


def test_a_service_certificate_may_not_generate(router: ServiceProcess, pki: DevPki) -> None:
    e = refused(lambda: generate(router, pki, "worker", [5] * BS))
    assert e.code() == grpc.StatusCode.PERMISSION_DENIED and "role worker" in (e.details() or "")
