"""STAND-IN for the Consul HTTP API (a test double; there is no Consul binary on these machines).

Implements the subset kvmesh uses, following Consul's documented behaviour:
``PUT /v1/agent/service/register`` (Check/Checks: TTL, GRPC+GRPCUseTLS, TCP; keys in any case or
snake_case as Consul's decoder accepts), ``PUT /v1/agent/service/deregister/<id>``,
``PUT /v1/agent/check/{pass,warn,fail}/<id>?note=``, ``PUT /v1/agent/check/update/<id>``,
``GET /v1/agent/services``, ``/v1/agent/checks``, ``/v1/agent/self``, ``/v1/status/leader``,
``GET /v1/health/service/<name>`` (``passing``, ``tag``), ``/v1/catalog/services``,
``/v1/catalog/service/<name>`` (``tag``). Blocking queries: ``index`` + ``wait`` (default 5m, max
10m, plus up to wait/16 jitter), returning early on change, with ``X-Consul-Index`` (monotonic,
>= 1), ``X-Consul-KnownLeader`` and ``X-Consul-LastContact``. Not implemented: ACLs, KV, ``filter``
expressions (answered 400 so misuse is visible), multiple nodes, HTTP and script checks.
"""

from __future__ import annotations

import asyncio
import json
import random
import re
import time
from typing import Any

from aiohttp import web

from tests.consul_standin.state import NODE_ID, AgentState, Check, Service

_DUR = re.compile(r"(\d+(?:\.\d+)?)(ns|us|µs|ms|s|m|h)")
_UNIT = {"ns": 1e-9, "us": 1e-6, "µs": 1e-6, "ms": 1e-3, "s": 1.0, "m": 60.0, "h": 3600.0}
MAX_WAIT_S = 600.0
DEFAULT_WAIT_S = 300.0


def parse_duration(v: Any) -> float:
    """Go duration (``"1.5s"``, ``"500ms"``, ``"1m30s"``) or a number of nanoseconds → seconds."""
    if isinstance(v, int | float):
        return float(v) / 1e9
    s = str(v).strip()
    if not s or s == "0":
        return 0.0
    parts = _DUR.findall(s)
    if "".join(n + u for n, u in parts) != s:
        raise ValueError(f"time: invalid duration {s!r}")
    return sum(float(n) * _UNIT[u] for n, u in parts)


def norm(d: Any) -> dict[str, Any]:
    """Keys lower-cased with ``_`` removed: ``GRPCUseTLS`` and ``grpc_use_tls`` both → ``grpcusetls``."""
    return {str(k).replace("_", "").lower(): v for k, v in (d or {}).items()} if isinstance(d, dict) else {}


def _bad(msg: str) -> web.Response:
    return web.Response(status=400, text=msg)


class StandinConsul:
    def __init__(self, state: AgentState) -> None:
        self.state = state

    # -- helpers -------------------------------------------------------------------------------
    def _headers(self, index: int) -> dict[str, str]:
        return {"X-Consul-Index": str(max(1, index)), "X-Consul-KnownLeader": "true", "X-Consul-LastContact": "0"}

    async def _block(self, request: web.Request, index_of: Any) -> int | web.Response:
        q = request.query
        if "filter" in q:
            return _bad("stand-in: filter expressions are not supported")
        try:
            min_index = int(q.get("index", "0") or 0)
        except ValueError:
            return _bad("Invalid index")
        try:
            wait = parse_duration(q["wait"]) if "wait" in q else DEFAULT_WAIT_S
        except ValueError:
            return _bad("Invalid wait time")
        if min_index > 0:
            wait = min(wait, MAX_WAIT_S) or DEFAULT_WAIT_S
            wait += random.uniform(0, wait / 16)
            deadline = time.monotonic() + wait
            async with self.state.cond:
                while index_of() <= min_index:
                    left = deadline - time.monotonic()
                    if left <= 0:
                        break
                    try:
                        await asyncio.wait_for(self.state.cond.wait(), left)
                    except TimeoutError:
                        break
        return int(index_of())

    def _json(self, body: Any, index: int) -> web.Response:
        return web.json_response(body, headers=self._headers(index))

    def _node(self) -> dict[str, Any]:
        s = self.state
        return {
            "ID": NODE_ID,
            "Node": s.node,
            "Address": s.address,
            "Datacenter": s.dc,
            "TaggedAddresses": {"lan": s.address, "wan": s.address},
            "Meta": {},
            "CreateIndex": 5,
            "ModifyIndex": 5,
        }

    def _check_json(self, c: Check) -> dict[str, Any]:
        svc = self.state.services.get(c.service_id)
        return {
            "Node": self.state.node,
            "CheckID": c.check_id,
            "Name": c.name,
            "Status": c.status,
            "Notes": c.notes,
            "Output": c.output,
            "ServiceID": c.service_id,
            "ServiceName": c.service_name,
            "ServiceTags": list(svc.tags) if svc else [],
            "Type": c.type,
            "Definition": {},
            "CreateIndex": c.create_index,
            "ModifyIndex": c.modify_index,
        }

    def _serf(self) -> dict[str, Any]:
        return {
            "Node": self.state.node,
            "CheckID": "serfHealth",
            "Name": "Serf Health Status",
            "Status": "passing",
            "Notes": "",
            "Output": "Agent alive and reachable",
            "ServiceID": "",
            "ServiceName": "",
            "ServiceTags": [],
            "Type": "",
            "Definition": {},
            "CreateIndex": 5,
            "ModifyIndex": 5,
        }

    def _service_json(self, s: Service) -> dict[str, Any]:
        return {
            "ID": s.id,
            "Service": s.name,
            "Tags": list(s.tags),
            "Address": s.address,
            "Meta": dict(s.meta),
            "Port": s.port,
            "Weights": dict(s.weights),
            "EnableTagOverride": False,
            "CreateIndex": s.create_index,
            "ModifyIndex": s.modify_index,
        }

    def _matching(self, name: str, request: web.Request) -> list[Service]:
        tags = request.query.getall("tag", [])
        return sorted(
            (s for s in self.state.services.values() if s.name == name and all(t in s.tags for t in tags)),
            key=lambda s: s.id,
        )

    # -- agent ---------------------------------------------------------------------------------
    def _parse_check(self, raw: Any, svc: Service, n: int, total: int) -> Check:
        c = norm(raw)
        cid = str(c.get("checkid") or c.get("id") or "")
        if not cid:
            cid = f"service:{svc.id}" + (f":{n + 1}" if total > 1 else "")
        status = str(c.get("status") or "critical")
        if status not in ("passing", "warning", "critical"):
            raise ValueError(f"Invalid check: status {status!r}")
        common: dict[str, Any] = dict(
            check_id=cid,
            name=str(c.get("name") or f"Service '{svc.name}' check"),
            service_id=svc.id,
            service_name=svc.name,
            status=status,
            notes=str(c.get("notes") or ""),
            deregister_after_s=parse_duration(c.get("deregistercriticalserviceafter") or 0),
        )
        if common["deregister_after_s"]:
            common["deregister_after_s"] = max(60.0, common["deregister_after_s"])  # Consul's minimum
        timeout = parse_duration(c.get("timeout") or "10s")
        if c.get("ttl"):
            ttl = parse_duration(c["ttl"])
            if ttl <= 0:
                raise ValueError("Invalid check: TTL must be > 0 for TTL checks")
            return Check(type="ttl", ttl_s=ttl, **common)
        interval = parse_duration(c.get("interval") or 0)
        if c.get("grpc") or c.get("tcp"):
            if interval <= 0:
                raise ValueError("Invalid check: Interval must be > 0 for GRPC and TCP checks")
            if c.get("grpc"):
                return Check(
                    type="grpc",
                    interval_s=interval,
                    timeout_s=timeout,
                    grpc=str(c["grpc"]),
                    grpc_use_tls=bool(c.get("grpcusetls", False)),
                    **common,
                )
            return Check(type="tcp", interval_s=interval, timeout_s=timeout, tcp=str(c["tcp"]), **common)
        raise ValueError("Invalid check: stand-in supports TTL, GRPC and TCP checks only")

    async def register(self, request: web.Request) -> web.Response:
        try:
            body = norm(json.loads(await request.text() or "{}"))
        except ValueError:
            return _bad("Request decode failed: invalid JSON")
        if not body.get("name"):
            return _bad("Missing service name")
        svc = Service(
            id=str(body.get("id") or body["name"]),
            name=str(body["name"]),
            tags=[str(t) for t in body.get("tags") or []],
            meta={str(k): str(v) for k, v in (body.get("meta") or {}).items()},
            address=str(body.get("address") or ""),
            port=int(body.get("port") or 0),
            weights={str(k): int(v) for k, v in (norm(body.get("weights")) or {}).items()}
            or {"Passing": 1, "Warning": 1},
        )
        svc.weights = {k.capitalize(): v for k, v in svc.weights.items()}
        raws = ([body["check"]] if body.get("check") else []) + list(body.get("checks") or [])
        try:
            checks = [self._parse_check(r, svc, i, len(raws)) for i, r in enumerate(raws)]
        except ValueError as e:
            return _bad(str(e))
        self.state.upsert_service(svc, checks)
        await self.state.changed()
        return web.Response(status=200)

    async def deregister(self, request: web.Request) -> web.Response:
        sid = request.match_info["id"]
        if not self.state.remove_service(sid):
            return web.Response(
                status=404,
                text=f'Unknown service ID "{sid}". Ensure that the service ID is passed, not the service name.',
            )
        await self.state.changed()
        return web.Response(status=200)

    async def check_update(self, request: web.Request) -> web.Response:
        cid, verb = request.match_info["id"], request.match_info["verb"]
        c = self.state.checks.get(cid)
        if c is None or c.type != "ttl":
            return web.Response(status=404, text=f'CheckID "{cid}" does not have associated TTL')
        if verb == "update":
            body = norm(json.loads(await request.text() or "{}"))
            status, output = str(body.get("status", "")), str(body.get("output", ""))
            if status not in ("passing", "warning", "critical"):
                return _bad(f"Invalid check status: {status!r}")
        else:
            status = {"pass": "passing", "warn": "warning", "fail": "critical"}[verb]
            output = request.query.get("note", "")
        self.state.set_check(cid, status, output)
        await self.state.changed()
        return web.Response(status=200)

    async def agent_services(self, request: web.Request) -> web.Response:
        return web.json_response(
            {s.id: {**self._service_json(s), "Datacenter": self.state.dc} for s in self.state.services.values()}
        )

    async def agent_checks(self, request: web.Request) -> web.Response:
        return web.json_response({c.check_id: self._check_json(c) for c in self.state.checks.values()})

    async def agent_self(self, request: web.Request) -> web.Response:
        return web.json_response(
            {
                "Config": {
                    "Datacenter": self.state.dc,
                    "NodeName": self.state.node,
                    "NodeID": NODE_ID,
                    "Version": "standin",
                },
                "Member": {"Name": self.state.node, "Addr": self.state.address},
            }
        )

    async def leader(self, request: web.Request) -> web.Response:
        return web.json_response(f"{self.state.address}:8300")

    # -- health / catalog ----------------------------------------------------------------------
    async def health_service(self, request: web.Request) -> web.Response:
        name = request.match_info["name"]
        idx = await self._block(request, lambda: self.state.health_index(name))
        if isinstance(idx, web.Response):
            return idx
        passing_q = request.query.get("passing")
        only_passing = passing_q is not None and passing_q.lower() not in ("false", "0")
        out = []
        for s in self._matching(name, request):
            checks = [self._serf()] + [
                self._check_json(c)
                for c in sorted(self.state.checks.values(), key=lambda c: c.check_id)
                if c.service_id == s.id
            ]
            if only_passing and any(c["Status"] != "passing" for c in checks):
                continue
            out.append({"Node": self._node(), "Service": self._service_json(s), "Checks": checks})
        return self._json(out, idx)

    async def catalog_services(self, request: web.Request) -> web.Response:
        idx = await self._block(request, lambda: self.state.catalog_index)
        if isinstance(idx, web.Response):
            return idx
        out: dict[str, list[str]] = {"consul": []}
        for s in self.state.services.values():
            out.setdefault(s.name, [])
            out[s.name] = sorted(set(out[s.name]) | set(s.tags))
        return self._json(out, idx)

    async def catalog_service(self, request: web.Request) -> web.Response:
        name = request.match_info["name"]
        idx = await self._block(request, lambda: self.state.health_index(name))
        if isinstance(idx, web.Response):
            return idx
        n = self._node()
        out = [
            {
                "ID": NODE_ID,
                "Node": n["Node"],
                "Address": n["Address"],
                "Datacenter": n["Datacenter"],
                "TaggedAddresses": n["TaggedAddresses"],
                "NodeMeta": {},
                "ServiceID": s.id,
                "ServiceName": s.name,
                "ServiceTags": list(s.tags),
                "ServiceAddress": s.address,
                "ServicePort": s.port,
                "ServiceMeta": dict(s.meta),
                "ServiceWeights": dict(s.weights),
                "ServiceEnableTagOverride": False,
                "CreateIndex": s.create_index,
                "ModifyIndex": s.modify_index,
            }
            for s in self._matching(name, request)
        ]
        return self._json(out, idx)

    def app(self) -> web.Application:
        app = web.Application()
        app.add_routes(
            [
                web.put("/v1/agent/service/register", self.register),
                web.put("/v1/agent/service/deregister/{id}", self.deregister),
                web.put(r"/v1/agent/check/{verb:pass|warn|fail|update}/{id}", self.check_update),
                web.get("/v1/agent/services", self.agent_services),
                web.get("/v1/agent/checks", self.agent_checks),
                web.get("/v1/agent/self", self.agent_self),
                web.get("/v1/status/leader", self.leader),
                web.get("/v1/health/service/{name}", self.health_service),
                web.get("/v1/catalog/services", self.catalog_services),
                web.get("/v1/catalog/service/{name}", self.catalog_service),
            ]
        )
        return app
