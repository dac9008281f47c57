"""What carries out the planner's decisions: dry-run (log only), local (worker processes on this host) or
kubernetes (the chart's worker Deployments, :mod:`kvmesh.services.planner.kubernetes`).

An actuator's ``start`` returns the new worker's id (the ``service_id`` it registers with, as the routers
list it); ``stop`` gets the id and address of a worker the planner has drained. ``start`` with a ``role``
(prefill/decode disaggregation: a worker restarted in the other role) is asked only of an actuator that
``changes_roles``: the local one (``--role`` added to its worker flags); the kubernetes one scales one
Deployment per zone, whose pods all have its one role, so the planner only reports role changes there.

The local actuator starts ``kvmesh-worker`` processes with ``--worker-args`` (plus ``--zone`` and a
``--service-id``), registers each in the static registry file the failover service reads (routers then
follow it), and stops only workers it started: deregistered first, then SIGTERM (the worker drains what it
still holds). Scale-in is drained by the planner through the router before ``stop`` is called.
"""

from __future__ import annotations

import asyncio
import logging
import shlex
import tempfile
from pathlib import Path
from typing import Protocol

from kvmesh.core.errors import InvalidArgument
from kvmesh.core.handoff import WorkerRole
from kvmesh.discovery.model import WORKER_ROLE_META, Role, ServiceInstance
from kvmesh.discovery.static import StaticRegistry
from kvmesh.services.planner.kubernetes import KubeApi, KubernetesWorkers
from kvmesh.services.planner.settings import PlannerSettings, zone_map
from kvmesh.suite.launcher import ServiceProcess, start_service

log = logging.getLogger(__name__)


class Actuator(Protocol):
    """Starts and stops workers of a zone."""

    name: str
    carries_out: bool  # False: decisions are only logged and counted
    changes_roles: bool  # False: role changes are only logged and counted

    async def start(self, zone: str, role: WorkerRole | None = None) -> str: ...

    async def stop(self, zone: str, address: str, worker_id: str) -> None: ...

    def removable(self, zone: str) -> set[str] | None:
        """Addresses of the zone's workers it can stop (None: any)."""
        ...

    async def close(self) -> None: ...


class DryRun:
    """Logs what it would do."""

    name = "dry-run"
    carries_out = False
    changes_roles = False

    async def start(self, zone: str, role: WorkerRole | None = None) -> str:
        log.info("dry-run: would start a worker%s in zone %s", f" of role {role}" if role else "", zone)
        return ""

    async def stop(self, zone: str, address: str, worker_id: str) -> None:
        log.info("dry-run: would stop worker %s (%s) of zone %s", worker_id, address, zone)

    def removable(self, zone: str) -> set[str] | None:
        return set()

    async def close(self) -> None:
        return None


class LocalWorkers:
    """Worker processes on this host, announced through a static registry file."""

    name = "local"
    carries_out = True
    changes_roles = True

    def __init__(self, registry_file: str, worker_args: str, log_dir: str = "") -> None:
        if not registry_file:
            raise InvalidArgument("registry_file", "the local actuator needs the failover service's registry file")
        self.registry = StaticRegistry(registry_file)
        self.args = shlex.split(worker_args)
        self.log_dir = Path(log_dir or tempfile.mkdtemp(prefix="kvmesh-planner-workers-"))
        self.procs: dict[str, tuple[str, str, ServiceProcess]] = {}  # address → (zone, id, process)
        self._seq = 0

    async def start(self, zone: str, role: WorkerRole | None = None) -> str:
        """A worker of `--worker-args`, in `role` when given (a later `--role` wins over the flags')."""
        self._seq += 1
        sid = f"worker-{zone}-planned-{self._seq}"
        args = [*self.args, "--zone", zone, "--service-id", sid, *(["--role", role.value] if role else [])]
        sp = await asyncio.to_thread(start_service, "worker", self.log_dir, *args)
        host, _, port = sp.address.rpartition(":")
        meta = {"http": f"{host}:{sp.http_port}"} | ({WORKER_ROLE_META: role.value} if role else {})
        await self.registry.register(ServiceInstance(sid, Role.WORKER, zone, "v1", host, int(port), meta=meta))
        self.procs[sp.address] = (zone, sid, sp)
        log.info("started worker %s at %s in zone %s", sid, sp.address, zone)
        return sid

    async def stop(self, zone: str, address: str, worker_id: str) -> None:
        zone_of, sid, sp = self.procs.pop(address)
        await self.registry.deregister(sid)
        code = await asyncio.to_thread(sp.terminate, 30.0)
        log.info("stopped worker %s (%s, zone %s): exit %s", sid, address, zone_of, code)

    def removable(self, zone: str) -> set[str] | None:
        return {a for a, (z, _, _) in self.procs.items() if z == zone}

    async def close(self) -> None:
        for address in list(self.procs):
            zone, sid, _ = self.procs[address]
            await self.stop(zone, address, sid)
        await self.registry.close()


def make_actuator(s: PlannerSettings) -> Actuator:
    """The actuator ``s.actuator`` names, from its settings (each missing one refused, naming its flag)."""
    if s.actuator == "dry-run":
        return DryRun()
    if s.actuator == "local":
        return LocalWorkers(s.registry_file, s.worker_args, s.worker_log_dir)
    if s.actuator == "kubernetes":
        api = KubeApi.in_cluster(s.kube_api_url, s.kube_namespace, s.kube_token_file, s.kube_ca_file)
        return KubernetesWorkers(api, zone_map("kube_deployments", s.kube_deployments, "deployment"))
    raise InvalidArgument("actuator", f"unknown actuator {s.actuator!r}; known: dry-run, local, kubernetes")
