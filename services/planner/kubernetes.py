"""The Kubernetes actuator: scales each zone's worker Deployment (deploy/helm/kvmesh) through the API server.

Scale-out raises the Deployment's ``scale`` subresource by one and waits for the pod the ReplicaSet creates
(the one the Deployment's selector matches that was not there before); its name is the worker's id, since
the chart sets ``KVMESH_SERVICE_ID`` to the pod name. Scale-in is drained through the router by the planner
first; then the drained pod gets the ``controller.kubernetes.io/pod-deletion-cost`` annotation at the
lowest cost, and the replicas go down by one, so that the ReplicaSet deletes that pod and no other (it
prefers pods not yet ready, which is why the planner never scales in while a worker is starting). The pod
gets SIGTERM and drains what it still holds.

Credentials: in a pod, the service account's token (re-read on every call: bound tokens rotate), CA and
namespace under ``/var/run/secrets/kubernetes.io/serviceaccount`` and the API server from
``KUBERNETES_SERVICE_HOST``/``_PORT``; each can be given instead (``--kube-*`` flags). The chart's planner
Role allows exactly these calls: get and patch ``deployments/scale``, get ``deployments``, list and patch
``pods``.
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import ssl
import time
from pathlib import Path
from typing import Any

import aiohttp

from kvmesh.core.errors import InvalidArgument, KvmeshError
from kvmesh.core.handoff import WorkerRole

log = logging.getLogger(__name__)
SA_DIR = Path("/var/run/secrets/kubernetes.io/serviceaccount")
DELETION_COST = "controller.kubernetes.io/pod-deletion-cost"
LOWEST_COST = str(-(2**31))  # int32, the annotation's range
MERGE_PATCH = "application/merge-patch+json"


class KubeError(KvmeshError):
    """A Kubernetes API call failed: the method, the path, the status and what the server said."""


class KubeApi:
    """The few calls of the Kubernetes API the planner makes, over HTTPS with a bearer token."""

    def __init__(self, url: str, namespace: str, token_file: str, ca_file: str = "", timeout_s: float = 10.0) -> None:
        if not url.startswith(("https://", "http://")):
            raise InvalidArgument("kube_api_url", f"expected https://host:port, got {url!r}")
        if not namespace:
            raise InvalidArgument("kube_namespace", "the namespace of the worker Deployments is needed")
        if not token_file or not Path(token_file).is_file():
            raise InvalidArgument("kube_token_file", f"no service-account token at {token_file!r}")
        self.url = url.rstrip("/")
        self.namespace = namespace
        self.token_file = token_file
        self._ssl: ssl.SSLContext | bool = ssl.create_default_context(cafile=ca_file) if ca_file else True
        self._timeout = aiohttp.ClientTimeout(total=timeout_s)
        self._session: aiohttp.ClientSession | None = None

    @classmethod
    def in_cluster(cls, url: str = "", namespace: str = "", token_file: str = "", ca_file: str = "") -> KubeApi:
        """Each argument left empty is taken from the pod's environment and service-account files."""
        if not url:
            host, port = os.environ.get("KUBERNETES_SERVICE_HOST", ""), os.environ.get("KUBERNETES_SERVICE_PORT", "")
            if not host:
                raise InvalidArgument("kube_api_url", "not in a pod (no KUBERNETES_SERVICE_HOST): give --kube-api-url")
            url = f"https://[{host}]:{port or 443}" if ":" in host else f"https://{host}:{port or 443}"
        if not namespace and (SA_DIR / "namespace").is_file():
            namespace = (SA_DIR / "namespace").read_text().strip()
        if not ca_file and (SA_DIR / "ca.crt").is_file():
            ca_file = str(SA_DIR / "ca.crt")
        return cls(url, namespace, token_file or str(SA_DIR / "token"), ca_file)

    async def _call(self, method: str, path: str, body: dict[str, Any] | None = None) -> dict[str, Any]:
        if self._session is None:
            self._session = aiohttp.ClientSession(timeout=self._timeout)
        token = (await asyncio.to_thread(Path(self.token_file).read_text)).strip()
        headers = {"Authorization": f"Bearer {token}", "Accept": "application/json"}
        data = None
        if body is not None:
            headers["Content-Type"] = MERGE_PATCH
            data = json.dumps(body)
        try:
            async with self._session.request(
                method, self.url + path, data=data, headers=headers, ssl=self._ssl
            ) as resp:
                text = await resp.text()
                if resp.status >= 300:
                    raise KubeError(f"{method} {path}: HTTP {resp.status}: {_reason(text)}")
                return json.loads(text) if text else {}
        except aiohttp.ClientError as exc:
            raise KubeError(f"{method} {path}: cannot reach the API server at {self.url}: {exc}") from exc

    def _apps(self, deployment: str, sub: str = "") -> str:
        return f"/apis/apps/v1/namespaces/{self.namespace}/deployments/{deployment}{sub}"

    async def replicas(self, deployment: str) -> int:
        return int((await self._call("GET", self._apps(deployment, "/scale")))["spec"].get("replicas", 0))

    async def set_replicas(self, deployment: str, replicas: int) -> None:
        await self._call("PATCH", self._apps(deployment, "/scale"), {"spec": {"replicas": replicas}})

    async def selector(self, deployment: str) -> str:
        """The Deployment's pod selector as a label selector string (``k=v,...``)."""
        labels = (await self._call("GET", self._apps(deployment)))["spec"]["selector"]["matchLabels"]
        return ",".join(f"{k}={v}" for k, v in sorted(labels.items()))

    async def pods(self, selector: str) -> list[dict[str, Any]]:
        """The pods the selector matches that are not being deleted."""
        doc = await self._call("GET", f"/api/v1/namespaces/{self.namespace}/pods?labelSelector={selector}")
        return [p for p in doc.get("items", []) if not p["metadata"].get("deletionTimestamp")]

    async def annotate_pod(self, pod: str, annotations: dict[str, str]) -> None:
        path = f"/api/v1/namespaces/{self.namespace}/pods/{pod}"
        await self._call("PATCH", path, {"metadata": {"annotations": annotations}})

    async def close(self) -> None:
        if self._session is not None:
            await self._session.close()
            self._session = None


def _reason(text: str) -> str:
    """The ``message`` of a Kubernetes Status body, else the body's start."""
    try:
        return str(json.loads(text).get("message") or text[:200])
    except (ValueError, AttributeError):
        return text[:200]


class KubernetesWorkers:
    """Workers as the pods of one Deployment per zone."""

    name = "kubernetes"
    carries_out = True
    changes_roles = False  # one Deployment per zone: its pods have its one role

    def __init__(
        self, api: KubeApi, deployments: dict[str, str], poll_s: float = 2.0, start_timeout_s: float = 900.0
    ) -> None:
        self.api = api
        self.deployments = deployments
        self.poll_s = poll_s
        self.start_timeout_s = start_timeout_s
        self._lock = asyncio.Lock()  # one read-modify-write of a replica count at a time
        self._claimed: set[str] = set()  # pods already returned by a start (two starts never share one)
        self._selectors: dict[str, str] = {}  # a Deployment's selector is immutable (apps/v1): read it once

    def _deployment(self, zone: str) -> str:
        if zone not in self.deployments:
            raise InvalidArgument("kube_deployments", f"no worker Deployment given for zone {zone!r}")
        return self.deployments[zone]

    async def start(self, zone: str, role: WorkerRole | None = None) -> str:
        """Adds a replica; returns the new pod's name (the worker's id) once the ReplicaSet has created it. A
        `role` is refused (`changes_roles` is False: the planner asks none)."""
        if role is not None:
            raise InvalidArgument("role", f"the kubernetes actuator starts the Deployment's workers, not {role}")
        dep = self._deployment(zone)
        if dep not in self._selectors:
            self._selectors[dep] = await self.api.selector(dep)
        selector = self._selectors[dep]
        async with self._lock:
            before = {p["metadata"]["name"] for p in await self.api.pods(selector)}
            n = await self.api.replicas(dep)
            await self.api.set_replicas(dep, n + 1)
        log.info("zone %s: %s scaled to %d replicas", zone, dep, n + 1)
        deadline = time.monotonic() + self.start_timeout_s
        while time.monotonic() < deadline:
            new = sorted(p["metadata"]["name"] for p in await self.api.pods(selector))
            created = [name for name in new if name not in before and name not in self._claimed]
            if created:
                self._claimed.add(created[0])
                return created[0]
            await asyncio.sleep(self.poll_s)  # the ReplicaSet controller's pace, not a synchronisation
        raise KubeError(f"{dep}: no new pod within {self.start_timeout_s:.0f} s of scaling to {n + 1}")

    async def stop(self, zone: str, address: str, worker_id: str) -> None:
        """Marks the drained pod cheapest to delete, then removes one replica."""
        dep = self._deployment(zone)
        async with self._lock:
            await self.api.annotate_pod(worker_id, {DELETION_COST: LOWEST_COST})
            n = await self.api.replicas(dep)
            await self.api.set_replicas(dep, max(n - 1, 0))
        self._claimed.discard(worker_id)  # its pod is gone: the set stays as small as the fleet
        log.info("zone %s: %s scaled to %d replicas, pod %s (%s) deleted first", zone, dep, n - 1, worker_id, address)

    def removable(self, zone: str) -> set[str] | None:
        return None  # every worker of the zone is a pod of its Deployment

    async def close(self) -> None:
        await self.api.close()  # the pods stay: the Deployment owns them
