"""STAND-IN for a Consul agent's check runners: TTL expiry, gRPC and TCP probes, the critical reaper.

* gRPC: like Consul's CheckGRPC, first run after a random stagger in [0, Interval), then every
  Interval; each run dials a fresh channel and calls ``grpc.health.v1.Health/Check`` (service =
  the part after ``/`` in the target) with deadline Timeout. SERVING → passing, else critical.
* TCP: connect within Timeout → passing, else critical.
* TTL: no update for TTL seconds → critical, output "TTL expired".
* Reaper: every `reap_interval_s` (Consul: 30 s) services whose check has been critical for longer
  than DeregisterCriticalServiceAfter (Consul's minimum: 1 minute) are deregistered.
"""

from __future__ import annotations

import asyncio
import random
import time

import grpc
import grpc.aio
from grpc_health.v1 import health_pb2, health_pb2_grpc

from tests.consul_standin.state import AgentState, Check

TICK_S = 0.05


async def probe_grpc(check: Check) -> tuple[str, str]:
    target, _, service = check.grpc.partition("/")
    creds = grpc.ssl_channel_credentials() if check.grpc_use_tls else None
    channel = grpc.aio.secure_channel(target, creds) if creds else grpc.aio.insecure_channel(target)
    try:
        stub = health_pb2_grpc.HealthStub(channel)
        resp = await stub.Check(health_pb2.HealthCheckRequest(service=service), timeout=check.timeout_s)
        status = health_pb2.HealthCheckResponse.ServingStatus.Name(resp.status)
        if resp.status == health_pb2.HealthCheckResponse.SERVING:
            return "passing", f"gRPC check {check.grpc}: success"
        return "critical", f"gRPC check {check.grpc}: failed: status {status}"
    except grpc.aio.AioRpcError as e:
        return "critical", f"gRPC check {check.grpc}: failed: {e.code().name}: {e.details()}"
    finally:
        await channel.close()


async def probe_tcp(check: Check) -> tuple[str, str]:
    host, _, port = check.tcp.rpartition(":")
    try:
        _, w = await asyncio.wait_for(asyncio.open_connection(host, int(port)), check.timeout_s)
        w.close()
        return "passing", f"TCP connect {check.tcp}: Success"
    except (OSError, TimeoutError) as e:
        return "critical", f"dial tcp {check.tcp}: {e!r}"


class CheckRunner:
    def __init__(self, state: AgentState, reap_interval_s: float = 30.0) -> None:
        self.state = state
        self.reap_interval_s = reap_interval_s
        # check id -> (the registration it probes, its task): a check deregistered and registered again under the
        # same id, even with the same definition, is a new `Check` and gets a new probe, as a real agent's AddCheck
        self._probes: dict[str, tuple[Check, asyncio.Task[None]]] = {}
        self._task: asyncio.Task[None] | None = None

    def start(self) -> None:
        self._task = asyncio.create_task(self._loop())

    async def stop(self) -> None:
        tasks = [t for _, t in self._probes.values()]
        if self._task:
            tasks.append(self._task)
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)

    def probe_of(self, check_id: str) -> asyncio.Task[None] | None:
        """The task probing check `check_id`, if one was started."""
        entry = self._probes.get(check_id)
        return entry[1] if entry else None

    async def _probe_loop(self, check: Check) -> None:
        """Probes `check` every interval while it is still the registered check of its id."""
        await asyncio.sleep(random.uniform(0, check.interval_s))
        while self.state.checks.get(check.check_id) is check:
            status, output = await (probe_grpc(check) if check.type == "grpc" else probe_tcp(check))
            if self.state.checks.get(check.check_id) is check:
                self.state.set_check(check.check_id, status, output)
                await self.state.changed()
            await asyncio.sleep(check.interval_s)

    def sync_probes(self) -> None:
        """One probe per registered gRPC / TCP check: probes of checks gone or replaced stop; a check without a
        running probe of its own (new, re-registered, or whose probe ended) gets one."""
        live = {cid: c for cid, c in self.state.checks.items() if c.type in ("grpc", "tcp")}
        for cid, (check, task) in list(self._probes.items()):
            if live.get(cid) is not check or task.done():
                task.cancel()
                del self._probes[cid]
        for cid, c in live.items():
            if cid not in self._probes:
                self._probes[cid] = (c, asyncio.create_task(self._probe_loop(c)))

    async def _loop(self) -> None:
        next_reap = time.monotonic() + self.reap_interval_s
        while True:
            self.sync_probes()
            now = time.monotonic()
            changed = False
            for c in list(self.state.checks.values()):
                if c.type == "ttl" and now >= c.ttl_deadline and c.status != "critical":
                    self.state.set_check(c.check_id, "critical", "TTL expired")
                    changed = True
            if now >= next_reap:
                next_reap = now + self.reap_interval_s
                for c in list(self.state.checks.values()):
                    if (
                        c.deregister_after_s > 0
                        and c.critical_since is not None
                        and now - c.critical_since > c.deregister_after_s
                    ):
                        changed |= self.state.remove_service(c.service_id)
            if changed:
                await self.state.changed()
            await asyncio.sleep(TICK_S)
