"""The shared skeleton of every kvmesh service.

`ServiceRunner` owns one `grpc.aio` server, one aiohttp HTTP server and the service's background work:
- gRPC: the service's servicers wrapped by `InstrumentedServer` (request id, deadline, tracing, metrics,
  error map per handler), `grpc.health.v1` health and server reflection, optional TLS / mTLS;
- HTTP: `GET /metrics` (Prometheus), `GET /healthz`, plus any routes the service adds (OpenAI API, admin);
  a malformed HTTP request or a client that went away is logged at INFO without a traceback; with TLS
  (`tls_cert`) the HTTP ports speak HTTPS only, with the gRPC port's certificate (a client certificate is
  optional there and, when presented, names the caller as on gRPC); `plain_http_port` adds a plaintext port
  serving only `/healthz` and `/metrics`; `probe` answers vLLM's `/health` and `/ping` for a service that
  installs them;
- authorisation (`kvmesh.security`): when the settings give an identity source (`auth_tokens_file`, mTLS) or
  `auth_mode=enforce`, every gRPC call (health and reflection included) and every HTTP request is admitted
  by the one table (`kvmesh.security.authz`) before its handler runs, the caller's identity set in
  `identity_var`; without one the service is open, as before the table;
- limits (`ServerLimits`, per service): the largest request message each gRPC method decodes (refused
  INVALID_ARGUMENT on its size, before decoding), the transport's own limit above that, and the largest
  HTTP body;
- background: `every(interval_s, fn)` periodic and `supervise(coro_fn)` restarted tasks
  (`kvmesh.rpc.background`), stopped in order on shutdown;
- self-registration: in Consul when `consul_url` is set, or in the registry given to `register_in`, retried
  in the background (the registry may be down at start; the service serves anyway), deregistered first thing
  on drain so routers stop sending before the server stops accepting; `set_meta` changes the registered
  meta (re-registration: the registry replaces the entry, its checks keep their status);
- lifecycle: `on_started` hooks run once the servers listen; on SIGTERM/SIGINT health turns NOT_SERVING,
  `stopping` is set (long-lived watch streams end cleanly), `on_stopping` hooks run, new calls are refused
  and in-flight calls get `grace_s` seconds to finish; then background tasks stop, `on_stopped` hooks run
  and the process exits 0. A `KvmeshError` or `OSError` from wiring or start-up exits 2 with its message.
Once serving, the start-up heap is frozen out of the garbage collector's full passes (`freeze_startup_heap`,
setting `gc_freeze`). Bound ports are written to `ready_file` (JSON) once everything serves, so callers never
poll with sleeps.
"""

from __future__ import annotations

import asyncio
import contextlib
import gc
import json
import logging
import os
import signal
import ssl
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, TypeVar

import grpc
from aiohttp import web
from aiohttp.http_exceptions import BadHttpMessage
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_health.v1._async import HealthServicer
from grpc_reflection.v1alpha import reflection, reflection_pb2_grpc

from kvmesh.core.config import EVENT_LOOPS, ServerSettings, load_settings
from kvmesh.core.errors import KvmeshError
from kvmesh.core.tasks import stop_task
from kvmesh.discovery.model import Health, Role, ServiceInstance
from kvmesh.discovery.registration import register_until_done, registry_from, self_instance
from kvmesh.discovery.registry import CheckSpec, HealthProbe, Registry
from kvmesh.rpc.auth import Guard, GuardedServer
from kvmesh.rpc.background import BackgroundTasks, Job
from kvmesh.rpc.http_auth import http_guard
from kvmesh.rpc.interceptors import InstrumentedServer, MessageBounds
from kvmesh.rpc.tls import server_credentials, server_ssl_context
from kvmesh.telemetry import metrics
from kvmesh.telemetry.logging import setup_logging
from kvmesh.telemetry.tracing import setup_tracing

log = logging.getLogger(__name__)

S = TypeVar("S", bound=ServerSettings)

DEFAULT_MAX_MESSAGE_BYTES = 64 * 1024 * 1024
DEFAULT_MAX_REQUEST_BYTES = DEFAULT_MAX_MESSAGE_BYTES // 2
STOPPING = web.AppKey("kvmesh_stopping", asyncio.Event)  # the runner's `stopping`, for handlers on its HTTP app


async def probe(request: web.Request) -> web.Response:
    """vLLM's `GET /health` and `GET|POST /ping` (vllm/entrypoints/serve/instrumentator/health.py, sagemaker):
    200 with an empty body while the service serves, 503 once it drains (vLLM: once its engine is dead)."""
    stopping = request.app.get(STOPPING)
    return web.Response(status=503 if stopping is not None and stopping.is_set() else 200)


@dataclass(frozen=True)
class ServerLimits:
    """What one service accepts: the largest request message each gRPC method decodes (`grpc_requests`,
    checked on the received bytes) and the largest HTTP body.

    The transport's own limit (grpc-core answers RESOURCE_EXHAUSTED) is twice the largest method bound: a
    backstop on memory only. grpc-core refuses an over-limit message after receiving all of it, and more
    slowly than it receives one: on a bare grpc.aio server here, 20 MB over a 17 MiB limit was refused in
    109-161 ms, accepted under a 64 MiB limit in 37-38 ms (`python -m kvmesh.bench oversize`). So a message up
    to the backstop is received and refused by its size, sooner (`kvmesh.rpc.interceptors.safe_deserializer`)."""

    grpc_requests: MessageBounds = field(default_factory=lambda: MessageBounds(DEFAULT_MAX_REQUEST_BYTES))
    http_max_body_bytes: int = DEFAULT_MAX_MESSAGE_BYTES

    @property
    def grpc_transport_bytes(self) -> int:
        return 2 * (self.grpc_requests.largest or DEFAULT_MAX_REQUEST_BYTES)


def _server_options(limits: ServerLimits, reuse_port: bool) -> list[tuple[str, int]]:
    return [
        ("grpc.max_send_message_length", DEFAULT_MAX_MESSAGE_BYTES),
        ("grpc.max_receive_message_length", limits.grpc_transport_bytes),
        ("grpc.keepalive_permit_without_calls", 1),
        ("grpc.http2.min_ping_interval_without_data_ms", 1_000),  # clients ping every 2 s (LIVENESS_OPTIONS)
        ("grpc.so_reuseport", int(reuse_port)),  # off unless asked: a second server on a taken port must fail
    ]


def freeze_startup_heap() -> int:
    """Collects once, then moves every object alive (modules, protobuf descriptors, tokenizers, settings: what
    start-up built and the process keeps) into the collector's permanent generation (`gc.freeze`); returns
    how many. Why: a full collection walks every tracked object, and a service's start-up heap made each one
    a pause of tens of milliseconds in the middle of requests (c1 p99 at 8K-token prompts 50-55 ms with
    16 workers and the router, 12-17 ms frozen: docs/benchmarks.md). What the service builds later is
    collected as before."""
    gc.collect()
    gc.freeze()
    return gc.get_freeze_count()


def write_ready_file(path: Path, payload: dict[str, Any]) -> None:
    """The ready file's JSON, replaced whole (a reader never sees half of it)."""
    tmp = path.with_suffix(path.suffix + ".tmp")
    tmp.write_text(json.dumps(payload))
    os.replace(tmp, path)


class QuietClientErrors(logging.Filter):
    """On aiohttp's `aiohttp.server` logger: a malformed request (`BadHttpMessage`: garbage on the port) or
    a client that closed its connection is the client's doing, free for it to repeat; logged at INFO with
    the error's one-line text instead of ERROR with a traceback."""

    def filter(self, record: logging.LogRecord) -> bool:
        exc = record.exc_info[1] if record.exc_info else None
        if isinstance(exc, BadHttpMessage | ConnectionResetError):
            record.levelno, record.levelname = logging.INFO, "INFO"
            one_line = " ".join(str(exc).split())
            record.msg, record.args = "%s: %s: %s", (record.getMessage(), type(exc).__name__, one_line)
            record.exc_info, record.exc_text = None, None
        return True


_QUIET = QuietClientErrors()

Hook = Callable[[], Awaitable[None]]


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
class Registration:
    """Where and how this instance registers itself; `owned` registries are closed by the runner."""

    registry: Registry
    check: CheckSpec
    probe: HealthProbe | None = None
    advertise_host: str = ""  # default: settings.advertise_address, else the bound gRPC address
    with_http_meta: bool = False
    owned: bool = False


@dataclass
class ServiceRunner:
    """Builds, starts, drains and stops one service process (see the module docstring)."""

    name: str
    settings: ServerSettings
    limits: ServerLimits = field(default_factory=ServerLimits)
    freeze_heap: bool = False  # `freeze_startup_heap` once serving (run_service: the gc_freeze setting)
    server: grpc.aio.Server = field(init=False)
    guard: Guard | None = field(init=False)
    health: HealthServicer = field(init=False)
    http_app: web.Application = field(init=False)
    stopping: asyncio.Event = field(init=False)
    ports: BoundPorts | None = field(init=False, default=None)
    process_http_port: int | None = field(init=False, default=None)
    plain_http_port: int | None = field(init=False, default=None)
    frozen_objects: int = field(init=False, default=0)
    on_started: list[Callable[[BoundPorts], Awaitable[None]]] = field(init=False, default_factory=list)
    on_stopping: list[Hook] = field(init=False, default_factory=list)
    on_stopped: list[Hook] = field(init=False, default_factory=list)
    background: BackgroundTasks = field(init=False)
    registration: Registration | None = field(init=False, default=None)
    _service_names: list[str] = field(init=False, default_factory=list)
    _http_runner: web.AppRunner | None = field(init=False, default=None)
    _plain_runner: web.AppRunner | None = field(init=False, default=None)
    _register_task: asyncio.Task[None] | None = field(init=False, default=None)
    _registered: str = field(init=False, default="")
    _instance: ServiceInstance | None = field(init=False, default=None)  # registered; meta without set_meta's
    _meta: dict[str, str] = field(init=False, default_factory=dict)  # set_meta's keys
    _published_meta: dict[str, str] | None = field(init=False, default=None)  # the meta the registry holds

    def __post_init__(self) -> None:
        self.server = grpc.aio.server(options=_server_options(self.limits, self.settings.reuse_port))
        self.guard = Guard.from_settings(self.settings, self.name)
        self.health = HealthServicer()
        health_pb2_grpc.add_HealthServicer_to_server(self.health, self._grpc_own())
        self.stopping = asyncio.Event()
        self.background = BackgroundTasks(self.stopping)
        self.http_app = web.Application(client_max_size=self.limits.http_max_body_bytes)
        self.http_app[STOPPING] = self.stopping
        if self.guard is not None:
            self.http_app.middlewares.append(http_guard(self.guard))
        if _QUIET not in logging.getLogger("aiohttp.server").filters:
            logging.getLogger("aiohttp.server").addFilter(_QUIET)
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
        server = InstrumentedServer(self.server, self.name, self.limits.grpc_requests, self.guard)
        add_to_server(servicer, server)  # type: ignore[arg-type]
        self._service_names.append(full_name)

    def _grpc_own(self) -> Any:
        """Where grpc's own services (health, reflection) register: behind the guard when there is one."""
        return self.server if self.guard is None else GuardedServer(self.server, self.guard)

    def every(self, interval_s: float, fn: Job, *, name: str) -> None:
        """Runs `await fn()` every `interval_s` seconds until shutdown (errors logged and counted); <= 0: off."""
        self.background.every(interval_s, fn, name=name)

    def supervise(self, coro_fn: Job, *, name: str) -> None:
        """Runs `await coro_fn()` until shutdown, restarted with bounded back-off when it raises."""
        self.background.supervise(coro_fn, name=name)

    def register_in(self, registry: Registry, check: CheckSpec, advertise_host: str = "") -> None:
        """Registers this instance in `registry` once serving (instead of the Consul default of `consul_url`);
        the caller keeps ownership of the registry (closes it)."""
        self.registration = Registration(registry, check, advertise_host=advertise_host)

    async def start(self) -> BoundPorts:
        """Binds and starts gRPC and HTTP, marks every service SERVING and writes the ready file."""
        s = self.settings
        health = health_pb2.DESCRIPTOR.services_by_name["Health"].full_name
        names = [*self._service_names, health, reflection.SERVICE_NAME]
        # registered by hand, not enable_server_reflection: that picks the sync servicer for a wrapped server
        reflection_pb2_grpc.add_ServerReflectionServicer_to_server(
            reflection.aio.ReflectionServicer(names), self._grpc_own()
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
        self._start_registration()
        if self.freeze_heap:
            self.frozen_objects = freeze_startup_heap()
        self._write_ready_file()
        log.info("%s serving gRPC on %s, HTTP on %s", self.name, self.ports.grpc_address, http_port)
        return self.ports

    async def serve(self) -> int:
        """Starts, waits for SIGTERM/SIGINT (or `request_stop`), drains and stops. Returns the exit code."""
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, self.request_stop)
        try:
            await self.start()
        except BaseException:  # e.g. a peer whose settings disagree: release what started, then fail
            await self.drain_and_stop()
            raise
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
        await self._deregister()
        for hook in self.on_stopping:
            with contextlib.suppress(Exception):
                await hook()
        await self.server.stop(self.settings.grace_s)
        for runner in (self._http_runner, self._plain_runner):
            if runner is not None:
                await runner.cleanup()
        await self.background.stop()
        for hook in self.on_stopped:
            try:
                await hook()
            except Exception:
                log.exception("stop hook failed")
        if self.settings.ready_file:
            with contextlib.suppress(OSError):
                Path(self.settings.ready_file).unlink()
        log.info("%s stopped", self.name)

    def _start_registration(self) -> None:
        """Registers in the background (zone, version, role; gRPC health check, TTL fallback)."""
        s, ports = self.settings, self.ports
        assert ports is not None
        reg = self.registration
        if reg is None and s.consul_url:
            consul = registry_from("", s.consul_url)
            assert consul is not None
            reg = self.registration = Registration(
                consul, CheckSpec(use_tls=bool(s.tls_cert)), self._probe, with_http_meta=True, owned=True
            )
        if reg is None:
            return
        http = f"{s.host}:{ports.http_port}" if ports.http_port else ""
        address = f"{reg.advertise_host}:{ports.grpc_port}" if reg.advertise_host else ""
        inst = self_instance(
            instance_id=self.service_id,
            role=Role(self.name),
            zone=s.zone,
            version=s.version,
            address=address or s.advertise_address or ports.grpc_address,
            meta={"http": http} if http and reg.with_http_meta else None,
        )
        base_meta = dict(inst.meta)
        inst = replace(inst, meta={**base_meta, **self._meta})

        async def register() -> None:
            if await register_until_done(reg.registry, inst, reg.check, reg.probe, self.stopping):
                self._registered, self._instance = inst.id, replace(inst, meta=base_meta)
                self._published_meta = dict(inst.meta)
                log.info("%s registered as %s", self.name, inst.id)
                await self._publish_meta()  # what set_meta changed meanwhile

        self._register_task = asyncio.create_task(register(), name="registration")

    async def set_meta(self, key: str, value: str) -> None:
        """Sets one key of this instance's registry meta ("" removes it). Once registered, re-registers with
        the new meta (a failure is logged and retried at the next call); before, the registration carries it."""
        if value:
            self._meta[key] = value
        else:
            self._meta.pop(key, None)
        await self._publish_meta()

    async def _publish_meta(self) -> None:
        reg, base = self.registration, self._instance
        if reg is None or base is None or not self._registered or self.stopping.is_set():
            return
        want = {**base.meta, **self._meta}
        if self._published_meta == want:
            return
        try:
            await asyncio.wait_for(reg.registry.register(replace(base, meta=want), reg.check, reg.probe), 3.0)
        except (KvmeshError, OSError, TimeoutError) as e:
            log.warning("re-registration of %s with new meta failed: %s", self._registered, e)
            return
        self._published_meta = want

    async def _probe(self) -> Health:
        return Health.CRITICAL if self.stopping.is_set() else Health.PASSING

    async def _deregister(self) -> None:
        """Stops a pending registration and removes this instance from the registry (bounded)."""
        reg = self.registration
        if reg is None:
            return
        await stop_task(self._register_task)
        if self._registered:
            with contextlib.suppress(KvmeshError, OSError, TimeoutError):
                await asyncio.wait_for(reg.registry.deregister(self._registered), 3.0)
        close = getattr(reg.registry, "close", None)
        if reg.owned and close is not None:
            with contextlib.suppress(KvmeshError, OSError, TimeoutError):
                await close(deregister=False)

    async def _start_http(self) -> int:
        s = self.settings
        # HTTPS with the gRPC port's files: the OpenAI API and the admin routes never go in the clear
        tls = server_ssl_context(s.tls_cert, s.tls_key, s.tls_client_ca, False) if s.tls_cert else None
        self._http_runner = web.AppRunner(self.http_app, access_log=None)
        await self._http_runner.setup()
        port = await self._start_site(self._http_runner, s.http_port, s.reuse_port, tls)
        if s.process_http_port >= 0:
            self.process_http_port = await self._start_site(self._http_runner, s.process_http_port, False, tls)
        if s.plain_http_port >= 0:  # probes and scrapers without TLS: these two routes and nothing else
            plain = web.Application()
            plain.router.add_get("/metrics", self._metrics)
            plain.router.add_get("/healthz", self._healthz)
            self._plain_runner = web.AppRunner(plain, access_log=None)
            await self._plain_runner.setup()
            self.plain_http_port = await self._start_site(self._plain_runner, s.plain_http_port, False, None)
        return port

    async def _start_site(self, runner: web.AppRunner, port: int, reuse_port: bool, tls: ssl.SSLContext | None) -> int:
        site = web.TCPSite(runner, self.settings.host, port, reuse_port=reuse_port or None, ssl_context=tls)
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
        if self.process_http_port is not None:
            payload["process_http_port"] = self.process_http_port
        if self.plain_http_port is not None:
            payload["plain_http_port"] = self.plain_http_port
        if self.ports.http_port is not None:
            payload["http_scheme"] = "https" if self.settings.tls_cert else "http"
        if self.frozen_objects:
            payload["gc_frozen_objects"] = self.frozen_objects
        write_ready_file(Path(self.settings.ready_file), payload)

    async def _metrics(self, _request: web.Request) -> web.Response:
        body, content_type = metrics.render_latest()
        return web.Response(body=body, headers={"Content-Type": content_type})

    async def _healthz(self, _request: web.Request) -> web.Response:
        if self.stopping.is_set():
            return web.json_response({"status": "NOT_SERVING"}, status=503)
        return web.json_response({"status": "SERVING", "service": self.name, "id": self.service_id})


def run_service(
    name: str,
    settings_cls: type[S],
    build: Callable[[ServiceRunner, S], Awaitable[None]],
    argv: Sequence[str] | None = None,
    limits: Callable[[S], ServerLimits] | None = None,
) -> int:
    """Entry point body of a service: settings, logging, tracing, then `build(runner, settings)` and serve;
    `limits` derives the service's `ServerLimits` from its settings (default: 32 MiB per request message,
    64 MiB HTTP bodies)."""
    settings = load_settings(settings_cls, argv, service=name.replace("-", "_"))
    setup_logging(
        name, settings.log_level, settings.log_format, settings.log_repeat_limit, settings.log_repeat_window_s
    )
    setup_tracing(name, settings.otlp_endpoint or None)

    async def main() -> int:
        runner = ServiceRunner(name, settings, limits(settings) if limits else ServerLimits(), settings.gc_freeze)
        await build(runner, settings)
        return await runner.serve()

    if settings.event_loop not in EVENT_LOOPS:
        log.error("%s: event_loop must be one of %s, got %r", name, ", ".join(EVENT_LOOPS), settings.event_loop)
        return 2
    try:
        if settings.event_loop == "uvloop":
            import uvloop  # only where asked for: the default loop is asyncio's

            return uvloop.run(main())
        return asyncio.run(main())
    except (OSError, KvmeshError) as exc:
        log.error("%s failed to start: %s", name, exc)
        return 2
