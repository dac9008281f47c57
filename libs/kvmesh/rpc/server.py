"""The shared server bootstrap of every kvmesh service.

`ServiceRunner` owns one `grpc.aio` server and one aiohttp HTTP server:
- gRPC: the service's servicers behind `ServiceInterceptor` (request id, deadline, tracing, metrics, error
  map), `grpc.health.v1` health and server reflection, optional TLS / mTLS;
- HTTP: `GET /metrics` (Prometheus), `GET /healthz`, plus any routes the service adds (OpenAI API, admin);
- lifecycle: on SIGTERM/SIGINT health turns NOT_SERVING, `stopping` is set (long-lived watch streams end
  cleanly), new calls are refused and in-flight calls get `grace_s` seconds to finish; then stop hooks run
  and the process exits 0.
Bound ports are written to `ready_file` (JSON) once everything serves, so callers never poll with sleeps.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import os
import signal
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeVar

import grpc
from aiohttp import web
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_health.v1._async import HealthServicer
from grpc_reflection.v1alpha import reflection

from kvmesh.config import ServerSettings, load_settings
from kvmesh.errors import KvmeshError
from kvmesh.rpc.interceptors import InstrumentedServer
from kvmesh.rpc.tls import server_credentials
from kvmesh.telemetry import metrics
from kvmesh.telemetry.logging import setup_logging
from kvmesh.telemetry.tracing import setup_tracing

log = logging.getLogger(__name__)

S = TypeVar("S", bound=ServerSettings)

_SERVER_OPTIONS = [
    ("grpc.max_send_message_length", 64 * 1024 * 1024),
    ("grpc.max_receive_message_length", 64 * 1024 * 1024),
    ("grpc.keepalive_permit_without_calls", 1),
    ("grpc.http2.min_ping_interval_without_data_ms", 5_000),
    ("grpc.so_reuseport", 0),
]

Hook = Callable[[], Awaitable[None]]

REGISTER_ATTEMPTS = 30


@dataclass
class BoundPorts:
    """Where a started service listens."""

    grpc_port: int
    http_port: int | None
    host: str

    @property
    def grpc_address(self) -> str:
        return f"{self.host}:{self.grpc_port}"


@dataclass
class ServiceRunner:
    """Builds, starts, drains and stops one service process (see the module docstring)."""

    name: str
    settings: ServerSettings
    server: grpc.aio.Server = field(init=False)
    health: HealthServicer = field(init=False)
    http_app: web.Application = field(init=False)
    stopping: asyncio.Event = field(init=False)
    ports: BoundPorts | None = field(init=False, default=None)
    on_started: list[Callable[[BoundPorts], Awaitable[None]]] = field(init=False, default_factory=list)
    on_stopping: list[Hook] = field(init=False, default_factory=list)
    on_stopped: list[Hook] = field(init=False, default_factory=list)
    _service_names: list[str] = field(init=False, default_factory=list)
    _http_runner: web.AppRunner | None = field(init=False, default=None)

    def __post_init__(self) -> None:
        self.server = grpc.aio.server(options=_SERVER_OPTIONS)
        self.health = HealthServicer()
        health_pb2_grpc.add_HealthServicer_to_server(self.health, self.server)
        self.stopping = asyncio.Event()
        self.http_app = web.Application(client_max_size=64 * 1024 * 1024)
        self.http_app.router.add_get("/metrics", self._metrics)
        self.http_app.router.add_get("/healthz", self._healthz)

    @property
    def service_id(self) -> str:
        """This instance's id (settings.service_id, else `<name>-<zone>-<grpc port>`)."""
        if self.settings.service_id:
            return self.settings.service_id
        port = self.ports.grpc_port if self.ports else self.settings.port
        return f"{self.name}-{self.settings.zone}-{port}"

    def add_servicer(
        self, add_to_server: Callable[[Any, grpc.aio.Server], None], servicer: Any, full_name: str
    ) -> None:
        """Registers a generated servicer; `full_name` (e.g. `kvmesh.v1.WorkerService`) gets health + reflection."""
        add_to_server(servicer, InstrumentedServer(self.server, self.name))  # type: ignore[arg-type]
        self._service_names.append(full_name)

    async def start(self) -> BoundPorts:
        """Binds and starts gRPC and HTTP, marks every service SERVING and writes the ready file."""
        s = self.settings
        reflection.enable_server_reflection(
            [*self._service_names, health_pb2.DESCRIPTOR.services_by_name["Health"].full_name, reflection.SERVICE_NAME],
            self.server,
        )
        address = f"{s.host}:{s.port}"
        if s.tls_cert:
            port = self.server.add_secure_port(address, server_credentials(s.tls_cert, s.tls_key, s.tls_client_ca))
        else:
            port = self.server.add_insecure_port(address)
        if port == 0:
            raise OSError(f"cannot bind gRPC to {address}")
        await self.server.start()
        http_port = await self._start_http() if s.http_port >= 0 else None
        self.ports = BoundPorts(grpc_port=port, http_port=http_port, host=s.host)
        for name in ("", *self._service_names):
            await self.health.set(name, health_pb2.HealthCheckResponse.SERVING)
        metrics.SERVICE_INFO.labels(self.name, s.zone, s.version).set(1)
        for hook in self.on_started:
            await hook(self.ports)
        if s.consul_url:
            await self._register_in_consul()
        self._write_ready_file()
        log.info("%s serving gRPC on %s, HTTP on %s", self.name, self.ports.grpc_address, http_port)
        return self.ports

    async def serve(self) -> int:
        """Starts, waits for SIGTERM/SIGINT (or `request_stop`), drains and stops. Returns the exit code."""
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, self.request_stop)
        await self.start()
        await self.stopping.wait()
        await self.drain_and_stop()
        return 0

    def request_stop(self) -> None:
        """Begins a graceful stop (idempotent)."""
        if not self.stopping.is_set():
            log.info("%s: stop requested, draining for up to %.1fs", self.name, self.settings.grace_s)
            self.stopping.set()

    async def drain_and_stop(self) -> None:
        """NOT_SERVING, refuse new calls, let in-flight ones finish within the grace period, run stop hooks."""
        self.stopping.set()
        await self.health.enter_graceful_shutdown()
        for hook in self.on_stopping:
            with contextlib.suppress(Exception):
                await hook()
        await self.server.stop(self.settings.grace_s)
        if self._http_runner is not None:
            await self._http_runner.cleanup()
        for hook in self.on_stopped:
            try:
                await hook()
            except Exception:
                log.exception("stop hook failed")
        if self.settings.ready_file:
            with contextlib.suppress(OSError):
                Path(self.settings.ready_file).unlink()
        log.info("%s stopped", self.name)

    async def _register_in_consul(self) -> None:
        """Registers this instance in Consul (zone, version, role; native gRPC health check, TTL fallback) in
        the background with bounded retries — Consul may be down at start and the service must serve anyway —
        and deregisters it first thing on drain, so routers stop sending before the server stops accepting."""
        from kvmesh.discovery.model import Health, Role
        from kvmesh.discovery.registration import register_self, registry_from
        from kvmesh.discovery.registry import CheckSpec

        assert self.ports is not None
        s, ports = self.settings, self.ports
        registry = registry_from("", s.consul_url)
        assert registry is not None
        registered: list[str] = []

        async def probe() -> Health:
            return Health.CRITICAL if self.stopping.is_set() else Health.PASSING

        async def register() -> None:
            http = f"{s.host}:{ports.http_port}" if ports.http_port else ""
            for attempt in range(REGISTER_ATTEMPTS):
                try:
                    inst = await register_self(
                        registry,
                        instance_id=self.service_id,
                        role=Role(self.name),
                        zone=s.zone,
                        version=s.version,
                        address=s.advertise_address or ports.grpc_address,
                        check=CheckSpec(use_tls=bool(s.tls_cert)),
                        probe=probe,
                        meta={"http": http} if http else None,
                    )
                    registered.append(inst.id)
                    log.info("%s registered in Consul at %s as %s", self.name, s.consul_url, inst.id)
                    return
                except (KvmeshError, OSError) as exc:
                    log.warning("Consul registration attempt %d failed: %s", attempt + 1, exc)
                    with contextlib.suppress(TimeoutError):
                        await asyncio.wait_for(self.stopping.wait(), min(5.0, 0.2 * 2**attempt))
                    if self.stopping.is_set():
                        return
            log.error("%s could not register in Consul after %d attempts", self.name, REGISTER_ATTEMPTS)

        task = asyncio.create_task(register())

        async def deregister() -> None:
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError, KvmeshError, OSError, TimeoutError):
                await task
            for instance_id in registered:
                with contextlib.suppress(KvmeshError, OSError, TimeoutError):
                    await asyncio.wait_for(registry.deregister(instance_id), 3.0)
            close = getattr(registry, "close", None)
            if close is not None:
                with contextlib.suppress(KvmeshError, OSError, TimeoutError):
                    await close(deregister=False)

        self.on_stopping.insert(0, deregister)

    async def _start_http(self) -> int:
        self._http_runner = web.AppRunner(self.http_app, access_log=None)
        await self._http_runner.setup()
        site = web.TCPSite(self._http_runner, self.settings.host, self.settings.http_port)
        await site.start()
        sockets = site._server.sockets if site._server is not None else []  # type: ignore[union-attr,attr-defined]
        return int(sockets[0].getsockname()[1])

    def _write_ready_file(self) -> None:
        if not self.settings.ready_file or self.ports is None:
            return
        payload = {
            "service": self.name,
            "id": self.service_id,
            "pid": os.getpid(),
            "zone": self.settings.zone,
            "grpc": self.ports.grpc_address,
            "grpc_port": self.ports.grpc_port,
            "http_port": self.ports.http_port,
        }
        path = Path(self.settings.ready_file)
        tmp = path.with_suffix(path.suffix + ".tmp")
        tmp.write_text(json.dumps(payload))
        os.replace(tmp, path)

    async def _metrics(self, _request: web.Request) -> web.Response:
        body, content_type = metrics.render_latest()
        return web.Response(body=body, headers={"Content-Type": content_type})

    async def _healthz(self, _request: web.Request) -> web.Response:
        if self.stopping.is_set():
            return web.json_response({"status": "NOT_SERVING"}, status=503)
        return web.json_response({"status": "SERVING", "service": self.name, "id": self.service_id})


Builder = Callable[[ServiceRunner, Any], Awaitable[None]]


def run_service(
    name: str,
    settings_cls: type[S],
    build: Callable[[ServiceRunner, S], Awaitable[None]],
    argv: Sequence[str] | None = None,
) -> int:
    """Entry point body of a service: settings, logging, tracing, then `build(runner, settings)` and serve."""
    settings = load_settings(settings_cls, argv, service=name.replace("-", "_"))
    setup_logging(name, settings.log_level, settings.log_format)
    setup_tracing(name, settings.otlp_endpoint or None)

    async def main() -> int:
        runner = ServiceRunner(name, settings)
        await build(runner, settings)
        return await runner.serve()

    try:
        return asyncio.run(main())
    except OSError as exc:
        log.error("%s failed to start: %s", name, exc)
        return 2
