"""The router's HTTP server as an operator meets it, against a real router process over real sockets: with TLS
its HTTP port speaks HTTPS only (the gRPC port's certificate from a development CA; a plaintext request is never
served), a client certificate there names the caller as on gRPC, `--plain-http-port` serves `/healthz` and
`/metrics` and nothing else in plaintext; vLLM's probe paths answer without credentials; a path with no route is
404 to every caller while a known route keeps its 401/403.

One router (no workers: nothing here generates) with the authorisation table (role tokens), client API keys
and mTLS on gRPC.
"""

from __future__ import annotations

import ssl
from collections.abc import Iterator
from dataclasses import dataclass

import grpc
import httpx
import pytest

from kvmesh.rpc.tls import client_ssl_context
from kvmesh.security.certs import DevPki, make_dev_pki
from kvmesh.security.identity import CallerRole, Identity
from kvmesh.security.tokens import accepted_file, provision, read_own_token
from kvmesh.suite.launcher import ServiceProcess, start_service

pytestmark = pytest.mark.integration
R = CallerRole
IDS = {
    "router": Identity(R.ROUTER, "router-https"),
    "admin": Identity(R.ADMIN, "operator"),
    "client": Identity(R.CLIENT, "demo"),
}
API_KEY = "sk-alice"


@dataclass
class Router:
    sp: ServiceProcess
    pki: DevPki
    tokens: dict[str, str]  # admin / client role tokens

    @property
    def https(self) -> str:
        return f"https://127.0.0.1:{self.sp.http_port}"

    def tls(self, who: str = "") -> ssl.SSLContext:
        """The suite CA, and `who`'s certificate presented when given."""
        pair = self.pki.pairs[IDS[who]] if who else None
        return client_ssl_context(str(self.pki.ca), *((str(pair.cert), str(pair.key)) if pair else ()))


@pytest.fixture(scope="module")
def router(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Router]:
    tmp = tmp_path_factory.mktemp("https")
    pki = make_dev_pki(tmp / "pki", list(IDS.values()))
    files = provision(tmp / "auth", list(IDS.values()))
    (tmp / "keys.yaml").write_text(f"- {{key: {API_KEY}, id: alice}}\n")
    pair, ca = pki.pairs[IDS["router"]], str(pki.ca)
    flags = ["--tls-cert", str(pair.cert), "--tls-key", str(pair.key), "--tls-client-ca", ca]
    flags += ["--auth-tokens-file", str(accepted_file(tmp / "auth")), "--api-keys-file", str(tmp / "keys.yaml")]
    admin = pki.pairs[IDS["admin"]]
    creds = grpc.ssl_channel_credentials(pki.ca.read_bytes(), admin.key.read_bytes(), admin.cert.read_bytes())
    sp = start_service("router", tmp, *flags, "--plain-http-port", "0", timeout=60, credentials=creds)
    try:
        yield Router(sp, pki, {n: read_own_token(str(files[IDS[n]])) for n in ("admin", "client")})
    finally:
        assert sp.terminate(timeout=30) == 0


def bearer(token: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {token}"}


def test_https_with_the_suite_ca_serves_and_plain_http_is_refused(router: Router) -> None:
    assert router.sp.info["http_scheme"] == "https"
    with httpx.Client(verify=router.tls(), timeout=10) as https:
        models = https.get(f"{router.https}/v1/models", headers=bearer(API_KEY))
        assert models.status_code == 200 and models.json()["object"] == "list", models.text
        workers = https.get(f"{router.https}/admin/workers", headers=bearer(router.tokens["admin"]))
        assert workers.status_code == 200 and "prefill_weight" in workers.json(), workers.text
        as_client = https.get(f"{router.https}/admin/workers", headers=bearer(router.tokens["client"]))
        assert as_client.status_code == 403, as_client.text
    with httpx.Client(verify=router.tls("admin"), timeout=10) as with_cert:  # the certificate names an admin
        assert with_cert.get(f"{router.https}/admin/workers").status_code == 200
    with httpx.Client(verify=router.tls("client"), timeout=10) as with_cert:
        assert with_cert.get(f"{router.https}/admin/workers").status_code == 403
    plain = f"http://127.0.0.1:{router.sp.http_port}"
    for path, token in (("/admin/workers", router.tokens["admin"]), ("/v1/models", API_KEY), ("/health", "")):
        with pytest.raises(httpx.TransportError):  # the TLS port never answers plaintext HTTP
            httpx.get(plain + path, headers=bearer(token) if token else {}, timeout=10)
    with pytest.raises(httpx.ConnectError):  # the certificate is the suite CA's, no public one
        httpx.get(f"{router.https}/health", timeout=10)


def test_the_plain_port_serves_only_health_and_metrics(router: Router) -> None:
    plain = f"http://127.0.0.1:{router.sp.info['plain_http_port']}"
    assert httpx.get(f"{plain}/healthz", timeout=10).json()["status"] == "SERVING"
    assert "kvmesh_" in httpx.get(f"{plain}/metrics", timeout=10).text
    for path in ("/v1/models", "/admin/workers", "/health"):
        assert httpx.get(plain + path, headers=bearer(router.tokens["admin"]), timeout=10).status_code == 404


def test_vllm_probe_paths_answer_without_credentials(router: Router) -> None:
    with httpx.Client(verify=router.tls(), timeout=10) as https:
        for method, path in (("GET", "/health"), ("GET", "/ping"), ("POST", "/ping")):
            for headers in ({}, bearer("not-a-key")):
                r = https.request(method, router.https + path, headers=headers)
                assert (r.status_code, r.content) == (200, b""), (method, path, r.status_code, r.text)


def test_a_path_with_no_route_is_404_for_every_caller_and_known_routes_keep_401_403(router: Router) -> None:
    with httpx.Client(verify=router.tls(), timeout=10) as https:
        for headers in ({}, bearer(router.tokens["admin"]), bearer(API_KEY), bearer("not-a-key")):
            r = https.get(f"{router.https}/v1/no-such-route", headers=headers)
            assert r.status_code == 404 and r.json()["error"]["type"] == "not_found_error", r.text
        assert https.get(f"{router.https}/admin/workers").status_code == 401
        assert https.get(f"{router.https}/admin/workers", headers=bearer("not-a-key")).status_code == 401
        assert https.get(f"{router.https}/admin/workers", headers=bearer(API_KEY)).status_code == 401
        assert https.get(f"{router.https}/v1/models").status_code == 401  # the router's own key check
        assert https.get(f"{router.https}/v1/models", headers=bearer("not-a-key")).status_code == 401
