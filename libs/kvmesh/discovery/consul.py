"""Consul registry over the Consul HTTP API, through `py-consul` (``consul.aio``).

* Register: ``PUT /v1/agent/service/register`` with Name ``kvmesh-<role>``, ID, Address, Port,
  Tags (``kvmesh``, ``zone=``, ``version=``, ``role=``) and Meta (zone, version, role, capacity),
  and one check with CheckID ``service:<id>``: a native gRPC check (``GRPC: host:port[/service]``,
  ``GRPCUseTLS``, ``Interval``, ``Timeout``). If the agent refuses it (HTTP 400) or
  ``mode="ttl"``, a TTL check is registered instead and refreshed every ``ttl_s / 3`` with
  ``PUT /v1/agent/check/{pass,warn,fail}/service:<id>`` from the service's own probe; a refresh
  answered 404 (agent restarted without its data dir) re-registers the service.
* Deregister: ``PUT /v1/agent/service/deregister/<id>``; `close()` deregisters what this object
  registered (shutdown).
* Snapshot: ``GET /v1/catalog/services`` (names starting ``kvmesh-`` or tagged ``kvmesh``) and
  ``GET /v1/health/service/<name>`` for each; instance health is the worst of its checks (node
  checks included, as Consul's ``passing`` filter does). Index = max of the ``X-Consul-Index``.
* Watch: blocking queries (``index=<i>&wait=<ms>ms``) on the catalog and on every known service in
  parallel; the first one returning an index different from `i` (greater: a change; smaller: a
  reset, per Consul's guidance) ends the watch and a fresh snapshot is taken. Each HTTP call has a
  deadline of ``wait + wait/16`` (Consul's jitter) plus `request_timeout_s`.
Unreachable agent, timeouts and 5xx answers raise `kvmesh.core.errors.Unavailable`.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Awaitable, Mapping
from typing import Any, TypeVar

import aiohttp
import consul
import consul.aio
import consul.exceptions as consul_errors

from kvmesh.core.errors import InvalidArgument, NotFound, Unavailable
from kvmesh.discovery.model import (
    KVMESH_TAG,
    SERVICE_PREFIX,
    CatalogSnapshot,
    Health,
    Role,
    ServiceInstance,
    parse_labels,
)
from kvmesh.discovery.registry import CheckSpec, HealthProbe

log = logging.getLogger(__name__)
T = TypeVar("T")


def go_duration(seconds: float) -> str:
    """Seconds as a Go duration string in whole milliseconds (``1.5`` → ``"1500ms"``)."""
    return f"{max(1, round(seconds * 1000))}ms"


def check_id(instance_id: str) -> str:
    return f"service:{instance_id}"


def grpc_check(instance: ServiceInstance, spec: CheckSpec) -> dict[str, Any]:
    target = instance.target + (f"/{spec.grpc_service}" if spec.grpc_service else "")
    out: dict[str, Any] = {
        "CheckID": check_id(instance.id),
        "Name": f"{instance.service_name} gRPC health",
        "GRPC": target,
        "GRPCUseTLS": spec.use_tls,
        "Interval": go_duration(spec.interval_s),
        "Timeout": go_duration(spec.timeout_s),
    }
    if spec.deregister_after_s > 0:
        out["DeregisterCriticalServiceAfter"] = go_duration(spec.deregister_after_s)
    return out


def ttl_check(instance: ServiceInstance, spec: CheckSpec) -> dict[str, Any]:
    out: dict[str, Any] = {
        "CheckID": check_id(instance.id),
        "Name": f"{instance.service_name} TTL",
        "TTL": go_duration(spec.ttl_s),
        "Status": "critical",
    }
    if spec.deregister_after_s > 0:
        out["DeregisterCriticalServiceAfter"] = go_duration(spec.deregister_after_s)
    return out


def parse_health_entry(entry: Mapping[str, Any]) -> ServiceInstance | None:
    """One ``/v1/health/service`` entry → instance (None when it lacks kvmesh labels)."""
    svc = entry.get("Service") or {}
    node = entry.get("Node") or {}
    labels = parse_labels(svc.get("Tags") or [], svc.get("Meta") or {})
    name = str(svc.get("Service", ""))
    role = labels.get("role") or (name[len(SERVICE_PREFIX) :] if name.startswith(SERVICE_PREFIX) else "")
    try:
        r = Role(role)
    except ValueError:
        return None
    statuses = []
    for c in entry.get("Checks") or []:
        try:
            statuses.append(Health(str(c.get("Status", "critical"))))
        except ValueError:
            statuses.append(Health.CRITICAL)  # e.g. "maintenance"
    try:
        return ServiceInstance(
            id=str(svc["ID"]),
            role=r,
            zone=labels.get("zone", ""),
            version=labels.get("version", ""),
            address=str(svc.get("Address") or node.get("Address") or "127.0.0.1"),
            port=int(svc.get("Port", 0)),
            health=Health.worst(statuses),
            capacity=float(labels.get("capacity", "1")),
            meta={k: str(v) for k, v in (svc.get("Meta") or {}).items()},
        )
    except (KeyError, ValueError, InvalidArgument) as e:
        log.warning("ignoring malformed Consul entry %s: %s", svc.get("ID"), e)
        return None


class ConsulRegistry:
    """`Registry` over a Consul agent (see the module docstring)."""

    def __init__(
        self,
        host: str = "127.0.0.1",
        port: int = 8500,
        *,
        scheme: str = "http",
        token: str | None = None,
        dc: str | None = None,
        request_timeout_s: float = 5.0,
    ) -> None:
        self.address = f"{scheme}://{host}:{port}"
        self._c = consul.aio.Consul(host=host, port=port, scheme=scheme, token=token, dc=dc, verify=scheme == "https")
        self.request_timeout_s = request_timeout_s
        self._registered: dict[str, tuple[ServiceInstance, dict[str, Any]]] = {}
        self._ttl_tasks: dict[str, asyncio.Task[None]] = {}
        self.check_modes: dict[str, str] = {}

    async def _call(self, aw: Awaitable[T], timeout_s: float | None = None) -> T:
        try:
            return await asyncio.wait_for(aw, timeout_s or self.request_timeout_s)
        except (aiohttp.ClientError, TimeoutError, OSError) as e:
            raise Unavailable(f"consul {self.address} unreachable: {e!r}") from e
        except consul.ConsulException as e:
            if isinstance(e, consul_errors.BadRequest | consul_errors.ClientError):
                raise  # the agent answered: a 4xx is the caller's problem, not unavailability
            raise Unavailable(f"consul {self.address} error: {e}") from e

    # -- registration --------------------------------------------------------------------------
    async def _put_service(self, instance: ServiceInstance, check: dict[str, Any]) -> None:
        ok = await self._call(
            self._c.agent.service.register(
                instance.service_name,
                service_id=instance.id,
                address=instance.address,
                port=instance.port,
                tags=instance.tags(),
                meta=instance.consul_meta(),
                check=check,
            )
        )
        if not ok:
            raise Unavailable(f"consul refused registration of {instance.id}")

    async def register(
        self, instance: ServiceInstance, check: CheckSpec | None = None, probe: HealthProbe | None = None
    ) -> None:
        spec = check or CheckSpec()
        if spec.mode not in ("grpc", "ttl"):
            raise InvalidArgument("check.mode", f"must be grpc or ttl, got {spec.mode!r}")
        mode = spec.mode
        if mode == "grpc":
            body = grpc_check(instance, spec)
            try:
                await self._put_service(instance, body)
            except consul_errors.BadRequest as e:
                log.warning("consul refused the gRPC check of %s (%s); falling back to TTL", instance.id, e)
                mode = "ttl"
        if mode == "ttl":
            body = ttl_check(instance, spec)
            await self._put_service(instance, body)
        self._registered[instance.id] = (instance, body)
        self.check_modes[instance.id] = mode
        if mode == "ttl":
            await self._report(instance.id, await probe() if probe else Health.PASSING)
            old = self._ttl_tasks.pop(instance.id, None)
            if old:
                old.cancel()
            self._ttl_tasks[instance.id] = asyncio.create_task(self._refresh_ttl(instance.id, spec, probe))

    async def _report(self, instance_id: str, health: Health) -> None:
        fn = {
            Health.PASSING: self._c.agent.check.ttl_pass,
            Health.WARNING: self._c.agent.check.ttl_warn,
            Health.CRITICAL: self._c.agent.check.ttl_fail,
        }[health]
        ok = await self._call(fn(check_id(instance_id), notes=f"kvmesh self-report: {health.value}"))
        if not ok:  # 404: the agent has no such TTL check (restarted without its data dir)
            raise NotFound(f"consul has no TTL check {check_id(instance_id)}")

    async def _refresh_ttl(self, instance_id: str, spec: CheckSpec, probe: HealthProbe | None) -> None:
        """Report health every ``ttl_s / 3`` until cancelled (deregister / close)."""
        period = max(0.05, spec.ttl_s / 3)
        while True:
            await asyncio.sleep(period)
            try:
                health = await asyncio.wait_for(probe(), period) if probe else Health.PASSING
            except Exception as e:
                log.warning("health probe of %s failed: %r", instance_id, e)
                health = Health.CRITICAL
            try:
                await self._report(instance_id, health)
            except NotFound:
                if instance_id in self._registered:
                    inst, body = self._registered[instance_id]
                    log.warning("consul lost the check of %s; re-registering", instance_id)
                    with contextlib.suppress(Unavailable, consul.ConsulException):
                        await self._put_service(inst, body)
            except (Unavailable, consul.ConsulException) as e:
                log.warning("TTL refresh of %s failed: %s", instance_id, e)

    async def deregister(self, instance_id: str) -> None:
        task = self._ttl_tasks.pop(instance_id, None)
        if task:
            task.cancel()
        self._registered.pop(instance_id, None)
        ok = await self._call(self._c.agent.service.deregister(instance_id))
        if not ok:
            raise NotFound(f"instance {instance_id!r} is not registered with the agent")

    # -- discovery -----------------------------------------------------------------------------
    async def _names(self, index: int = 0, wait_s: float = 0.0) -> tuple[int, list[str]]:
        kw: dict[str, Any] = {"index": index, "wait": go_duration(wait_s)} if index > 0 else {}
        idx, services = await self._call(self._c.catalog.services(**kw), self._deadline(index, wait_s))
        names = sorted(n for n, tags in (services or {}).items() if n.startswith(SERVICE_PREFIX) or KVMESH_TAG in tags)
        return int(idx), names

    async def _health(self, name: str, index: int = 0, wait_s: float = 0.0) -> tuple[int, list[Any]]:
        kw: dict[str, Any] = {"index": index, "wait": go_duration(wait_s)} if index > 0 else {}
        idx, nodes = await self._call(self._c.health.service(name, **kw), self._deadline(index, wait_s))
        return int(idx), list(nodes or [])

    def _deadline(self, index: int, wait_s: float) -> float:
        return (wait_s + wait_s / 16 if index > 0 else 0.0) + self.request_timeout_s

    async def snapshot(self) -> tuple[int, CatalogSnapshot]:
        idx, names = await self._names()
        results = await asyncio.gather(*(self._health(n) for n in names))
        instances: list[ServiceInstance] = []
        for hidx, entries in results:
            idx = max(idx, hidx)
            instances += [i for i in map(parse_health_entry, entries) if i is not None]
        return max(1, idx), CatalogSnapshot.of(instances)

    async def watch(self, index: int, wait_s: float) -> tuple[int, CatalogSnapshot]:
        if index <= 0:
            return await self.snapshot()
        _, names = await self._names()
        tasks = [asyncio.ensure_future(self._names(index, wait_s))]
        tasks += [asyncio.ensure_future(self._health(n, index, wait_s)) for n in names]
        try:
            pending = set(tasks)
            while pending:
                done, pending = await asyncio.wait(pending, return_when=asyncio.FIRST_COMPLETED)
                if any(t.result()[0] != index for t in done):  # result() re-raises Unavailable
                    break
        finally:
            for t in tasks:
                t.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
        return await self.snapshot()

    async def close(self, deregister: bool = True) -> None:
        """Stop TTL refreshes, deregister what this object registered (best effort), close HTTP."""
        for t in self._ttl_tasks.values():
            t.cancel()
        self._ttl_tasks.clear()
        if deregister:
            for iid in list(self._registered):
                try:
                    await self.deregister(iid)
                except (Unavailable, NotFound, consul.ConsulException) as e:
                    log.warning("deregistering %s on shutdown failed: %s", iid, e)
        await self._c.http.close()
