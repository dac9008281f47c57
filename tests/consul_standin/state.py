"""STAND-IN for a Consul agent's state: one node, its services and checks, and the Raft-like index.

Index rules (as in Consul): one global, strictly increasing index; every write that changes
something stamps the affected entries' ModifyIndex with a new index. The index of
``/v1/catalog/services`` is the last change of the set of services (or their tags); the index of
``/v1/health/service/<n>`` and ``/v1/catalog/service/<n>`` is the last change of service `n` or of
its checks' status (an unknown name answers the catalog index). Writes that change nothing (a
TTL pass on a passing check, an identical re-registration) do not move any index.
"""

from __future__ import annotations

import asyncio
import json
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

NODE_ID = "5f1a0b2c-0000-4000-8000-00000000c0de"


@dataclass
class Service:
    id: str
    name: str
    tags: list[str]
    meta: dict[str, str]
    address: str
    port: int
    weights: dict[str, int]
    create_index: int = 0
    modify_index: int = 0


@dataclass
class Check:
    check_id: str
    name: str
    service_id: str
    service_name: str
    type: str  # "ttl", "grpc", "tcp"
    status: str = "critical"
    output: str = ""
    notes: str = ""
    interval_s: float = 0.0
    timeout_s: float = 10.0
    ttl_s: float = 0.0
    grpc: str = ""
    grpc_use_tls: bool = False
    tcp: str = ""
    deregister_after_s: float = 0.0
    create_index: int = 0
    modify_index: int = 0
    ttl_deadline: float = 0.0  # monotonic
    critical_since: float | None = None  # monotonic

    def definition(self) -> dict[str, Any]:
        d = asdict(self)
        for k in ("status", "output", "create_index", "modify_index", "ttl_deadline", "critical_since"):
            d.pop(k)
        return d


@dataclass
class AgentState:
    node: str = "standin-node"
    dc: str = "dc1"
    address: str = "127.0.0.1"
    data_dir: Path | None = None
    index: int = 10
    catalog_index: int = 10
    service_index: dict[str, int] = field(default_factory=dict)
    services: dict[str, Service] = field(default_factory=dict)
    checks: dict[str, Check] = field(default_factory=dict)
    cond: asyncio.Condition = field(default_factory=asyncio.Condition)

    # -- index ---------------------------------------------------------------------------------
    def bump(self) -> int:
        self.index += 1
        return self.index

    async def changed(self) -> None:
        async with self.cond:
            self.cond.notify_all()

    def health_index(self, name: str) -> int:
        return self.service_index.get(name, self.catalog_index)

    # -- writes --------------------------------------------------------------------------------
    def upsert_service(self, svc: Service, checks: list[Check]) -> None:
        old = self.services.get(svc.id)
        same = old is not None and (old.name, old.tags, old.meta, old.address, old.port, old.weights) == (
            svc.name,
            svc.tags,
            svc.meta,
            svc.address,
            svc.port,
            svc.weights,
        )
        old_defs = {c.check_id: c.definition() for c in self.checks.values() if c.service_id == svc.id}
        new_defs = {c.check_id: c.definition() for c in checks}
        if same and old_defs == new_defs:
            return
        idx = self.bump()
        svc.create_index = old.create_index if old else idx
        svc.modify_index = idx
        self.services[svc.id] = svc
        for cid in set(old_defs) - set(new_defs):
            del self.checks[cid]
        now = time.monotonic()
        for c in checks:
            prev = self.checks.get(c.check_id)
            if prev is not None and old_defs.get(c.check_id) == new_defs[c.check_id]:
                continue  # unchanged check keeps its status
            c.create_index = c.modify_index = idx
            c.ttl_deadline = now + c.ttl_s
            c.critical_since = now if c.status == "critical" else None
            self.checks[c.check_id] = c
        self.service_index[svc.name] = idx
        if old is None or old.tags != svc.tags or old.name != svc.name:
            self.catalog_index = idx
            if old is not None and old.name != svc.name:
                self.service_index[old.name] = idx
        self.persist()

    def remove_service(self, service_id: str) -> bool:
        svc = self.services.pop(service_id, None)
        if svc is None:
            return False
        idx = self.bump()
        for cid in [c.check_id for c in self.checks.values() if c.service_id == service_id]:
            del self.checks[cid]
        self.service_index[svc.name] = idx
        self.catalog_index = idx
        self.persist()
        return True

    def set_check(self, check_id: str, status: str, output: str) -> None:
        c = self.checks[check_id]
        now = time.monotonic()
        if c.type == "ttl":
            c.ttl_deadline = now + c.ttl_s
        c.output = output
        if c.status == status:
            return
        c.status = status
        c.critical_since = (c.critical_since or now) if status == "critical" else None
        idx = self.bump()
        c.modify_index = idx
        self.service_index[c.service_name] = idx

    # -- data dir (a real agent restores its local services and checks from it) ---------------
    def persist(self) -> None:
        if self.data_dir is None:
            return
        self.data_dir.mkdir(parents=True, exist_ok=True)
        body = {
            "services": [asdict(s) for s in self.services.values()],
            "checks": [c.definition() for c in self.checks.values()],
        }
        tmp = self.data_dir / "local.json.tmp"
        tmp.write_text(json.dumps(body))
        tmp.replace(self.data_dir / "local.json")

    def restore(self) -> None:
        if self.data_dir is None or not (self.data_dir / "local.json").exists():
            return
        body = json.loads((self.data_dir / "local.json").read_text())
        checks = [Check(**c) for c in body["checks"]]
        for s in body["services"]:
            svc = Service(**{k: v for k, v in s.items() if k not in ("create_index", "modify_index")})
            self.upsert_service(svc, [c for c in checks if c.service_id == svc.id])
