"""A stand-in for the Kubernetes API server (there is no cluster here): one namespace, its Deployments'
``scale`` subresource, their pods, and the ReplicaSet controller's choice of which pods to create and delete.

Faithful where the planner's Kubernetes actuator depends on it (the paths, verbs and bodies of the real API):
- HTTPS; a bearer token per caller, 401 without a known one; each token holds RBAC rules (verb, resource),
  403 with the API server's message otherwise (``pods "x" is forbidden: ... cannot patch resource "pods"``);
- ``GET /apis/apps/v1/namespaces/NS/deployments/NAME`` and ``GET``/``PATCH .../NAME/scale`` (autoscaling/v1
  Scale); PATCH takes ``application/merge-patch+json`` only (415 otherwise); 404 Status for unknown names;
- ``GET /api/v1/namespaces/NS/pods?labelSelector=k=v,...`` (equality selectors) and ``PATCH .../pods/NAME``
  (a merge patch of metadata.annotations);
- the controller: a scale-up creates pods ``<deployment>-<template hash>-<5 characters>``, not ready; a
  scale-down deletes the ReplicaSet controller's order: not ready before ready, then the lowest
  ``controller.kubernetes.io/pod-deletion-cost`` first, then the newest. ``deleted`` records each deletion.
Readiness is set by the test (``ready``): there are no kubelets. With ``manual_controller`` a scale patch only
sets the replica count (and ``scaled``); pods follow when the test calls ``reconcile()``, as a real
controller's pods come some time after the patch.
"""

from __future__ import annotations

import asyncio
import itertools
import json
import ssl
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from aiohttp import web

DELETION_COST = "controller.kubernetes.io/pod-deletion-cost"


@dataclass
class Pod:
    name: str
    labels: dict[str, str]
    created: int
    ready: bool = False
    annotations: dict[str, str] = field(default_factory=dict)

    def doc(self) -> dict[str, Any]:
        cond = [{"type": "Ready", "status": "True" if self.ready else "False"}]
        meta = {"name": self.name, "labels": self.labels, "annotations": self.annotations}
        return {"apiVersion": "v1", "kind": "Pod", "metadata": meta, "status": {"conditions": cond}}


@dataclass
class Deployment:
    name: str
    labels: dict[str, str]
    replicas: int = 0
    pods: list[Pod] = field(default_factory=list)


def _status(code: int, reason: str, message: str) -> web.Response:
    body = {"kind": "Status", "apiVersion": "v1", "status": "Failure", "message": message, "reason": reason}
    return web.json_response(body, status=code)


class KubeApiStandIn:
    """Serves the API on 127.0.0.1 with ``cert``/``key``; ``tokens`` maps a token to its (verb, resource) rules."""

    def __init__(self, namespace: str, tokens: dict[str, set[tuple[str, str]]], cert: Path, key: Path) -> None:
        self.namespace = namespace
        self.tokens = tokens
        self.deployments: dict[str, Deployment] = {}
        self.deleted: list[str] = []
        self.requests: list[tuple[str, str]] = []
        self._ids = itertools.count()
        self._ssl = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
        self._ssl.load_cert_chain(cert, key)
        self._runner: web.AppRunner | None = None
        self.url = ""
        self.manual_controller = False
        self.scaled = asyncio.Event()

    def add_deployment(self, name: str, labels: dict[str, str], replicas: int, ready: bool = True) -> None:
        dep = Deployment(name, labels)
        self.deployments[name] = dep
        self._reconcile(dep, replicas)
        for p in dep.pods:
            p.ready = ready

    def ready(self, pod: str) -> None:
        for dep in self.deployments.values():
            for p in dep.pods:
                if p.name == pod:
                    p.ready = True

    def reconcile(self) -> None:
        for dep in self.deployments.values():
            self._reconcile(dep, dep.replicas)

    def _reconcile(self, dep: Deployment, replicas: int) -> None:
        dep.replicas = replicas
        while len(dep.pods) < replicas:
            n = next(self._ids)
            dep.pods.append(Pod(f"{dep.name}-5d8f7c9b4-{n:05x}", dict(dep.labels), n))
        while len(dep.pods) > replicas:
            victim = min(dep.pods, key=lambda p: (p.ready, int(p.annotations.get(DELETION_COST, "0")), -p.created))
            dep.pods.remove(victim)
            self.deleted.append(victim.name)

    async def start(self) -> None:
        app = web.Application()
        ns = f"/namespaces/{self.namespace}"
        app.router.add_route("*", "/apis/apps/v1" + ns + "/deployments/{name}", self._deployment)
        app.router.add_route("*", "/apis/apps/v1" + ns + "/deployments/{name}/scale", self._scale)
        app.router.add_route("*", "/api/v1" + ns + "/pods", self._pods)
        app.router.add_route("*", "/api/v1" + ns + "/pods/{name}", self._pod)
        self._runner = web.AppRunner(app)
        await self._runner.setup()
        site = web.TCPSite(self._runner, "127.0.0.1", 0, ssl_context=self._ssl)
        await site.start()
        port = self._runner.addresses[0][1]
        self.url = f"https://127.0.0.1:{port}"

    async def stop(self) -> None:
        if self._runner is not None:
            await self._runner.cleanup()

    def _deny(self, request: web.Request, verb: str, resource: str, name: str) -> web.Response | None:
        self.requests.append((request.method, request.path_qs))
        token = request.headers.get("Authorization", "").removeprefix("Bearer ")
        if token not in self.tokens:
            return _status(401, "Unauthorized", "Unauthorized")
        if (verb, resource) not in self.tokens[token]:
            what = f'{resource.split("/")[0]} "{name}"' if name else resource
            msg = (
                f'{what} is forbidden: User "system:serviceaccount:{self.namespace}:caller" cannot {verb} '
                f'resource "{resource}" in API group "" in the namespace "{self.namespace}"'
            )
            return _status(403, "Forbidden", msg)
        if request.method == "PATCH" and request.content_type != "application/merge-patch+json":
            return _status(
                415, "UnsupportedMediaType", f"the body of the request was in an unknown format: {request.content_type}"
            )
        return None

    def _find(self, name: str) -> Deployment | None:
        return self.deployments.get(name)

    async def _deployment(self, request: web.Request) -> web.Response:
        name = request.match_info["name"]
        if (denied := self._deny(request, "get", "deployments", name)) is not None:
            return denied
        if (dep := self._find(name)) is None:
            return _status(404, "NotFound", f'deployments.apps "{name}" not found')
        spec = {"replicas": dep.replicas, "selector": {"matchLabels": dep.labels}}
        return web.json_response(
            {"apiVersion": "apps/v1", "kind": "Deployment", "metadata": {"name": name}, "spec": spec}
        )

    async def _scale(self, request: web.Request) -> web.Response:
        name = request.match_info["name"]
        verb = "patch" if request.method == "PATCH" else "get"
        if (denied := self._deny(request, verb, "deployments/scale", name)) is not None:
            return denied
        if (dep := self._find(name)) is None:
            return _status(404, "NotFound", f'deployments.apps "{name}" not found')
        if verb == "patch":
            patch = json.loads(await request.text())
            replicas = patch.get("spec", {}).get("replicas")
            if not isinstance(replicas, int) or replicas < 0:
                return _status(422, "Invalid", f"spec.replicas: Invalid value: {replicas!r}")
            if self.manual_controller:
                dep.replicas = replicas
            else:
                self._reconcile(dep, replicas)
            self.scaled.set()
        body = {"apiVersion": "autoscaling/v1", "kind": "Scale", "metadata": {"name": name}}
        return web.json_response({**body, "spec": {"replicas": dep.replicas}, "status": {"replicas": len(dep.pods)}})

    async def _pods(self, request: web.Request) -> web.Response:
        if (denied := self._deny(request, "list", "pods", "")) is not None:
            return denied
        want = dict(kv.split("=", 1) for kv in request.query.get("labelSelector", "").split(",") if kv)
        pods = [p for d in self.deployments.values() for p in d.pods if want.items() <= p.labels.items()]
        return web.json_response({"apiVersion": "v1", "kind": "PodList", "items": [p.doc() for p in pods]})

    async def _pod(self, request: web.Request) -> web.Response:
        name = request.match_info["name"]
        if (denied := self._deny(request, "patch", "pods", name)) is not None:
            return denied
        pod = next((p for d in self.deployments.values() for p in d.pods if p.name == name), None)
        if pod is None:
            return _status(404, "NotFound", f'pods "{name}" not found')
        patch = json.loads(await request.text())
        pod.annotations.update(patch.get("metadata", {}).get("annotations", {}))
        return web.json_response(pod.doc())
