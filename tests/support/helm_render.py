"""Render a Helm chart with the real Helm library (helm-sdkpy's Helm v4 Go library), no helm binary, no cluster.

helm-sdkpy exposes Helm's install action but no client-only dry run (`helm template`), so the install runs
against a recording stand-in for the Kubernetes API on loopback (`_FakeApiServer`): it answers the version
(`KUBE_VERSION`, which Helm's `.Capabilities.KubeVersion` reads) and the discovery documents of the API groups
a cluster with cert-manager serves, answers 404 to every lookup, and 201 with the object itself to every
create. It validates nothing and schedules nothing: the rendered manifests come from Helm's own template
engine (`release["manifest"]`, also the objects Helm sent), their validity from `kubernetes-validate`.

Run as a subprocess (`python -m tests.support.helm_render CHART VALUES.json`, JSON on stdout) so that the Go
runtime and its environment (HELM_DRIVER=memory: releases are kept in memory, not in Secrets) stay out of the
test process.
"""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
import tempfile
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import yaml

KUBE_VERSION = "1.33.0"

# (group/version, [(plural, kind, namespaced)]) that the stand-in serves, as a cluster with cert-manager does
_RESOURCES: dict[str, list[tuple[str, str, bool]]] = {
    "v1": [
        ("services", "Service", True),
        ("configmaps", "ConfigMap", True),
        ("secrets", "Secret", True),
        ("serviceaccounts", "ServiceAccount", True),
        ("pods", "Pod", True),
        ("namespaces", "Namespace", False),
    ],
    "apps/v1": [("deployments", "Deployment", True), ("statefulsets", "StatefulSet", True)],
    "policy/v1": [("poddisruptionbudgets", "PodDisruptionBudget", True)],
    "networking.k8s.io/v1": [("networkpolicies", "NetworkPolicy", True)],
    "rbac.authorization.k8s.io/v1": [("roles", "Role", True), ("rolebindings", "RoleBinding", True)],
    "cert-manager.io/v1": [
        ("certificates", "Certificate", True),
        ("issuers", "Issuer", True),
        ("clusterissuers", "ClusterIssuer", False),
    ],
}


class _Handler(BaseHTTPRequestHandler):
    created: list[dict[str, Any]]

    def log_message(self, *_args: Any) -> None:
        pass

    def _send(self, code: int, body: dict[str, Any]) -> None:
        data = json.dumps(body).encode()
        self.send_response(code)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def _not_found(self) -> None:
        self._send(404, {"kind": "Status", "apiVersion": "v1", "status": "Failure", "reason": "NotFound", "code": 404})

    def do_GET(self) -> None:
        path = self.path.split("?")[0].rstrip("/")
        major, minor, _ = KUBE_VERSION.split(".")
        if path == "/version":
            self._send(200, {"major": major, "minor": minor, "gitVersion": f"v{KUBE_VERSION}", "platform": "linux"})
        elif path == "/api":
            self._send(200, {"kind": "APIVersions", "versions": ["v1"], "serverAddressByClientCIDRs": []})
        elif path == "/apis":
            groups: list[dict[str, Any]] = []
            for gv in (g for g in _RESOURCES if "/" in g):
                version = {"groupVersion": gv, "version": gv.split("/")[1]}
                groups.append({"name": gv.split("/")[0], "versions": [version], "preferredVersion": version})
            self._send(200, {"kind": "APIGroupList", "apiVersion": "v1", "groups": groups})
        elif (gv := "v1" if path == "/api/v1" else path.removeprefix("/apis/")) in _RESOURCES:
            resources = [
                {"name": p, "singularName": "", "namespaced": ns, "kind": k, "verbs": ["create", "get", "list"]}
                for p, k, ns in _RESOURCES[gv]
            ]
            self._send(200, {"kind": "APIResourceList", "apiVersion": "v1", "groupVersion": gv, "resources": resources})
        else:
            self._not_found()

    def do_POST(self) -> None:
        obj = json.loads(self.rfile.read(int(self.headers.get("Content-Length", "0"))) or b"{}")
        self.created.append(obj)
        self._send(201, obj)


def _serve() -> tuple[ThreadingHTTPServer, list[dict[str, Any]]]:
    created: list[dict[str, Any]] = []
    handler = type("Handler", (_Handler,), {"created": created})
    server = ThreadingHTTPServer(("127.0.0.1", 0), handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    return server, created


def _kubeconfig(port: int) -> str:
    return yaml.safe_dump(
        {
            "apiVersion": "v1",
            "kind": "Config",
            "clusters": [{"name": "stand-in", "cluster": {"server": f"http://127.0.0.1:{port}"}}],
            "users": [{"name": "nobody", "user": {}}],
            "contexts": [{"name": "stand-in", "context": {"cluster": "stand-in", "user": "nobody"}}],
            "current-context": "stand-in",
        }
    )


async def _install(chart: str, values: dict[str, Any], port: int, namespace: str) -> dict[str, Any]:
    import helm_sdkpy

    config = helm_sdkpy.Configuration(namespace=namespace, kubeconfig=_kubeconfig(port))
    return await helm_sdkpy.Install(config).run("kvmesh", chart, values=values, wait=False, timeout=60)


def _main(chart: str, values_file: str, namespace: str = "kvmesh") -> None:
    import helm_sdkpy

    server, created = _serve()
    try:
        release = asyncio.run(_install(chart, json.loads(Path(values_file).read_text()), server.server_port, namespace))
    except helm_sdkpy.HelmError as err:
        print(err, file=sys.stderr)
        sys.exit(2)
    finally:
        server.shutdown()
    manifests = [d for d in yaml.safe_load_all(release.get("manifest", "")) if d]
    json.dump({"manifests": manifests, "created": created, "release": release.get("info", {})}, sys.stdout)


def render(chart: Path, values: dict[str, Any]) -> dict[str, Any]:
    """`{"manifests": [...], "created": [...]}`: the chart rendered by Helm for `values` (merged over the
    chart's values.yaml, as `-f` does); RuntimeError with Helm's message when it refuses."""
    with tempfile.TemporaryDirectory(prefix="kvmesh-helm-") as tmp:
        vfile = Path(tmp) / "values.json"
        vfile.write_text(json.dumps(values))
        env = {
            **os.environ,
            "HELM_DRIVER": "memory",
            "HELM_CACHE_HOME": f"{tmp}/cache",
            "HELM_CONFIG_HOME": f"{tmp}/config",
            "HELM_DATA_HOME": f"{tmp}/data",
        }
        out = subprocess.run(
            [sys.executable, "-m", "tests.support.helm_render", str(chart), str(vfile)],
            capture_output=True,
            text=True,
            timeout=180,
            env=env,
            cwd=Path(__file__).resolve().parents[2],
        )
    if out.returncode != 0:
        raise RuntimeError(f"helm refused the chart: {out.stderr.strip()[-3000:]}")
    return dict(json.loads(out.stdout))


if __name__ == "__main__":
    _main(sys.argv[1], sys.argv[2])
