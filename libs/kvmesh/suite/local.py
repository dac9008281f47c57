"""The local suite `kvmesh up` lays out: per zone a cache-manager, its workers, a router and a failover service,
each its own process, on the ports of its `SuiteSettings` (`kvmesh.suite.config`), all sharing one static
registry (every failover service sees every zone) and one set of provisioned identities.

`start(settings, run_dir)` checks every fixed port first (a port in use is a `PortsInUse` naming the port, the
service, its key and the flag that moves it; nothing is started then), starts the zones, and on any failure
kills whatever it had started, so no half-started suite is left behind. The zones start at the same time,
and so do a zone's workers: a suite of N vLLM workers waits for one engine load, not N in a row. With several
zones, each zone's cache-manager follows the others' and replicates its hot prefixes into them
(`cacheManager.replicationBytesPerS`, default 50 MB/s; 0 = follow only): the zones are active-active.

A disaggregated zone (`worker.prefillReplicas`, `worker.decodeReplicas`) starts worker i with `--role` of
`WorkerSettings.roles()` (prefill workers first) and `--host-label` of this machine (one host: every handoff is a
same-host one), each with its CPU tier (`worker.cpuTierMb`, the kv-sync handoff's source); the registry carries
the role as the `worker_role` meta key (`kvmesh.discovery.model.WORKER_ROLE_META`).
"""

from __future__ import annotations

import dataclasses
import os
import shutil
import socket
import subprocess
import time
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import Any

import grpc
import yaml

from kvmesh.core.modelfiles import resolve_model_dir
from kvmesh.core.ports import free_port, ports_in_use
from kvmesh.discovery.model import WORKER_ROLE_META, CatalogSnapshot, Role, ServiceInstance
from kvmesh.discovery.static import write_catalog
from kvmesh.rpc.tls import channel_credentials
from kvmesh.security.certs import DevPki, make_dev_pki
from kvmesh.security.identity import CallerRole, Identity
from kvmesh.security.tokens import accepted_file, provision
from kvmesh.suite.config import PlannedPort, SuiteSettings, ZoneSettings, plan
from kvmesh.suite.launcher import ServiceProcess, StartWatch, start_service, vllm_core_env

HOST = "127.0.0.1"


def kvmesh_home() -> Path:
    return Path(os.environ.get("KVMESH_HOME", Path.cwd() / "var")).resolve()


def run_dir() -> Path:
    """Where a local suite keeps its state, identities, logs and checkpoints: ``$KVMESH_HOME/run``."""
    return kvmesh_home() / "run"


def state_path() -> Path:
    """The running suite's state file (its services' addresses and pids, its credentials' files)."""
    return run_dir() / "suite.json"


class PortsInUse(RuntimeError):
    """Fixed ports of the suite that something else listens on already."""

    def __init__(self, busy: list[PlannedPort]) -> None:
        lines = [
            f"port {p.port} is in use ({p.what}, {p.key}): free it or move it with {p.flag.replace('=N', '=PORT')}"
            + ("" if p.flag.startswith("--set") else " PORT")
            for p in busy
        ]
        lines.append("or let every service pick a free port: kvmesh up --ports auto")
        super().__init__("\n".join(lines))


def suite_identities(zone: str, workers: int) -> dict[str, Identity]:
    """The identities `kvmesh up` (and `kvmesh certs`) provisions for one zone, by name; a worker's is named by
    its service id and carries it as its id, the worker its KV events name."""
    R = CallerRole
    return {
        "cache-manager": Identity(R.CACHE_MANAGER, f"cache-manager-{zone}", zone),
        **{f"worker-{zone}-{i}": Identity(R.WORKER, f"worker-{zone}-{i}", zone) for i in range(workers)},
        "router": Identity(R.ROUTER, f"router-{zone}", zone),
        "failover": Identity(R.FAILOVER, f"failover-{zone}", zone),
        "planner": Identity(R.PLANNER, f"planner-{zone}", zone),
        "admin": Identity(R.ADMIN, "operator", zone),
        "client": Identity(R.CLIENT, "demo", zone, tenants=("demo",)),
        "peer-zone": Identity(R.PEER_ZONE, f"peer-of-{zone}", zone),
    }


SHARED = ("admin", "client", "peer-zone")  # one operator, one demo client for the whole suite (first zone's)


class SuiteAuth:
    """Per-service identities of one suite: tokens always, certificates with TLS; the flags each service is
    started with (by its identity's id: `router-<zone>`, `worker-<zone>-<i>` ...), and the state `status` /
    `demo` connect with."""

    def __init__(self, rd: Path, zones: list[tuple[str, int]], tls: bool) -> None:
        self.ids: dict[str, Identity] = {}
        for k, (zone, workers) in enumerate(zones):
            for name, ident in suite_identities(zone, workers).items():
                if name not in SHARED:
                    self.ids[ident.id] = ident
                elif k == 0:
                    self.ids[name] = ident
        self.token_files = provision(rd / "auth", list(self.ids.values()))
        self.accepted = accepted_file(rd / "auth")
        self.pki: DevPki | None = make_dev_pki(rd / "pki", list(self.ids.values())) if tls else None

    def flags(self, name: str, mode: str) -> list[str]:
        ident = self.ids[name]
        out = ["--auth-mode", mode, "--auth-tokens-file", str(self.accepted)]
        out += ["--auth-token-file", str(self.token_files[ident])]
        if self.pki is not None:
            pair, ca = self.pki.pairs[ident], str(self.pki.ca)
            out += ["--tls-cert", str(pair.cert), "--tls-key", str(pair.key), "--tls-client-ca", ca, "--tls-ca", ca]
            out += ["--tls-client-cert", str(pair.cert), "--tls-client-key", str(pair.key)]
        return out

    def credentials(self) -> grpc.ChannelCredentials | None:
        """The operator's mTLS credentials (None without TLS)."""
        if self.pki is None:
            return None
        pair = self.pki.pairs[self.ids["admin"]]
        return channel_credentials(str(self.pki.ca), str(pair.cert), str(pair.key))

    def state(self) -> dict[str, Any]:
        """What the state file records: the operator's and the demo client's token and certificate files."""
        out: dict[str, Any] = {
            "tokens": {n: str(self.token_files[self.ids[n]]) for n in ("admin", "client")},
            "tls": None,
        }
        if self.pki is not None:
            pairs = {n: self.pki.pairs[self.ids[n]] for n in ("admin", "client")}
            out["tls"] = {"ca": str(self.pki.ca), **{n: [str(p.cert), str(p.key)] for n, p in pairs.items()}}
        return out


@dataclass
class Suite:
    services: list[ServiceProcess]
    redis: subprocess.Popen[bytes] | None
    auth: SuiteAuth

    def kill(self) -> None:
        for sp in reversed(self.services):
            sp.kill()
        if self.redis is not None:
            self.redis.kill()
            self.redis.wait(timeout=10)


def check_ports(s: SuiteSettings) -> None:
    """Raises PortsInUse for every fixed port of the plan that is taken (nothing is started)."""
    planned = plan(s)
    busy = set(ports_in_use([p.port for p in planned], HOST))
    if busy:
        raise PortsInUse([p for p in planned if p.port in busy])


def start(s: SuiteSettings, rd: Path, run: Path | None = None, watch: StartWatch | None = None) -> Suite:
    """Checks the ports and the model, then starts every zone; kills what it started if anything fails. The
    identities live in `rd`, this run's state (logs, checkpoints, registry, planner history) in `run` (default
    `rd`); `watch` is told of each service as it starts and as it serves."""
    run = run or rd
    check_ports(s)
    s = _with_model(_zone_peers_addressable(s))
    auth = SuiteAuth(rd, [(z.name, z.worker.replicas) for z in s.zones], s.tls.enabled)
    if watch is not None:
        watch.provisioned(auth.state())
    suite = Suite([], None, auth)
    try:
        redis_url = s.redis.url
        if s.redis.enabled and not redis_url:
            suite.redis, redis_url = _start_redis(run / "redis", s.redis.port)
        total = sum(z.worker.replicas for z in s.zones)
        envs = vllm_core_env(total) if any(z.worker.engine == "vllm" for z in s.zones) else [{}] * total
        starts = []
        for z in s.zones:
            zone_envs, envs = envs[: z.worker.replicas], envs[z.worker.replicas :]
            starts.append(partial(_start_zone, s, z, run, auth, redis_url, zone_envs, watch))
        suite.services += _start_together(starts)
        registry = run / "registry.yaml"
        _write_registry(registry, suite.services, worker_roles(s))
        for z in s.zones:
            suite.services.append(_start_failover(s, z, run, auth, registry, watch))
        routers = {str(p.info.get("zone")): p.address for p in suite.services if p.name == "router"}
        for z in s.zones:
            if z.planner.enabled:
                suite.services.append(_start_planner(s, z, run, auth, routers[z.name], watch))
    except BaseException:
        suite.kill()
        raise
    return suite


def _zone_peers_addressable(s: SuiteSettings) -> SuiteSettings:
    """With several zones, every cache-manager's gRPC port made concrete before anything starts (`ports.auto`
    leaves them 0): each zone's cache-manager is given the others' addresses to follow (docs/zones.md)."""
    if len(s.zones) < 2:
        return s
    zones = tuple(
        z
        if z.cache_manager.grpc_port
        else dataclasses.replace(z, cache_manager=dataclasses.replace(z.cache_manager, grpc_port=free_port(HOST)))
        for z in s.zones
    )
    return dataclasses.replace(s, zones=zones)


def _zone_flags(s: SuiteSettings, z: ZoneSettings) -> list[str]:
    """A cache-manager's following of the other zones and its hot-prefix replication into them."""
    out: list[str] = []
    for other in s.zones:
        if other.name != z.name:
            out += ["--follow-zone", f"{other.name}={HOST}:{other.cache_manager.grpc_port}"]
    if out and z.cache_manager.replication_bytes_per_s > 0:
        out += ["--replication-bytes-per-s", str(z.cache_manager.replication_bytes_per_s)]
    return out


def _with_model(s: SuiteSettings) -> SuiteSettings:
    """The default model's folder (`kvmesh.core.modelfiles`: $KVMESH_HOME's, else the user's cache) made explicit,
    so that every vLLM worker and router of the suite loads the same one."""
    if s.model.path or not any(z.worker.engine == "vllm" for z in s.zones):
        return s
    found = resolve_model_dir("")
    if found is None:
        raise SystemExit("vLLM workers and no model.path: build the tiny model with scripts/build_tiny_model.py")
    return dataclasses.replace(s, model=dataclasses.replace(s.model, path=str(found)))


def _common(s: SuiteSettings, z: ZoneSettings, auth: SuiteAuth, ident: str) -> list[str]:
    out = ["--zone", z.name, "--version", s.version, "--log-level", s.log_level]
    out += ["--log-format", s.telemetry.log_format, *auth.flags(ident, s.auth.mode)]
    return out + (["--otlp-endpoint", s.telemetry.otlp_endpoint] if s.telemetry.otlp_endpoint else [])


def _start_zone(
    s: SuiteSettings,
    z: ZoneSettings,
    rd: Path,
    auth: SuiteAuth,
    redis_url: str,
    envs: list[dict[str, str]],
    watch: StartWatch | None = None,
) -> list[ServiceProcess]:
    logs, creds, bs, cm_s = rd / "logs", auth.credentials(), str(s.model.block_size), z.cache_manager
    started: list[ServiceProcess] = []
    try:
        cm_flags = [*_common(s, z, auth, f"cache-manager-{z.name}"), "--block-size", bs, "--model", s.model.salt]
        cm_flags += ["--checkpoint-dir", str(rd / "checkpoints" / z.name)]
        cm_flags += ["--checkpoint-interval-s", str(cm_s.checkpoint_interval_s), *_zone_flags(s, z)]
        if redis_url:
            cm_flags += ["--redis-url", redis_url, "--redis-prefix", f"kvmesh:cm:{z.name}"]
        cache = start_service(
            "cache-manager",
            logs,
            *cm_flags,
            timeout=60,
            credentials=creds,
            port=cm_s.grpc_port,
            http_port=cm_s.http_port,
            watch=watch,
        )
        started.append(cache)
        started += _start_together(
            [partial(_start_worker, s, z, rd, auth, cache.address, i, envs[i], watch) for i in range(z.worker.replicas)]
        )
        started.append(_start_router(s, z, rd, auth, cache.address, [p.address for p in started[1:]], watch))
    except BaseException:
        for sp in reversed(started):
            sp.kill()
        raise
    return started


def _start_worker(
    s: SuiteSettings,
    z: ZoneSettings,
    rd: Path,
    auth: SuiteAuth,
    cache: str,
    i: int,
    env: dict[str, str],
    watch: StartWatch | None = None,
) -> ServiceProcess:
    w, sid = z.worker, f"worker-{z.name}-{i}"
    flags = [*_common(s, z, auth, sid), "--service-id", sid, "--engine", w.engine]
    flags += ["--block-size", str(s.model.block_size), "--cache-manager", cache]
    flags += ["--max-model-len", str(w.max_model_len), "--kv-blocks", str(w.kv_blocks), "--sim-speed", str(w.sim_speed)]
    flags += ["--kvsync-port", str(w.kv_sync_port + i if w.kv_sync_port else 0)]
    flags += ["--cpu-tier-mb", str(w.cpu_tier_mb), "--role", w.roles()[i].value]
    flags += ["--host-label", socket.gethostname()] if w.disaggregated else []
    flags += ["--frames-port", "0"] if z.router.worker_transport == "frames" else []  # its listener is opt-in
    flags += ["--model", s.model.path] if s.model.path else []
    flags += ["--vllm-args", w.vllm_args] if w.vllm_args else []
    return start_service(
        "worker",
        rd / "logs",
        *flags,
        env=env,
        timeout=300 if w.engine == "vllm" else 60,
        credentials=auth.credentials(),
        port=w.grpc_port + i if w.grpc_port else 0,
        http_port=w.http_port + i if w.http_port else 0,
        watch=watch,
    )


def _start_together(starts: Sequence[Callable[[], ServiceProcess | list[ServiceProcess]]]) -> list[ServiceProcess]:
    """Runs every start at once and returns what they started, in order. If any fails (or the caller is
    interrupted), it waits for the others, kills everything they started and re-raises the first failure."""
    pool = ThreadPoolExecutor(max(len(starts), 1))
    futures = [pool.submit(start) for start in starts]
    try:
        return [sp for f in futures for sp in _as_list(f.result())]
    except BaseException:
        pool.shutdown(wait=True)
        for f in futures:
            if not f.cancelled() and f.exception() is None:
                for sp in _as_list(f.result()):
                    sp.kill()
        raise
    finally:
        pool.shutdown(wait=False)


def _as_list(started: ServiceProcess | list[ServiceProcess]) -> list[ServiceProcess]:
    return started if isinstance(started, list) else [started]


def _start_router(
    s: SuiteSettings,
    z: ZoneSettings,
    rd: Path,
    auth: SuiteAuth,
    cache: str,
    workers: list[str],
    watch: StartWatch | None = None,
) -> ServiceProcess:
    r = z.router
    flags = [*_common(s, z, auth, f"router-{z.name}"), "--block-size", str(s.model.block_size)]
    flags += ["--cache-manager", cache, "--workers", ",".join(workers), "--salt-model", s.model.salt]
    flags += ["--long-prompt-tokens", str(r.long_prompt_tokens), "--processes", str(r.processes)]
    flags += ["--worker-transport", r.worker_transport]
    flags += ["--model", s.model.path] if s.model.path else []
    flags += ["--model-name", s.model.name] if s.model.name else []
    flags += ["--tool-call-parser", s.model.tool_call_parser] if s.model.tool_call_parser else []
    flags += ["--reasoning-parser", s.model.reasoning_parser] if s.model.reasoning_parser else []
    flags += ["--api-keys-file", r.api_keys_file] if r.api_keys_file else []
    flags += ["--guardrails", r.guardrails] if r.guardrails else []
    if isinstance(r.profile, dict):  # an inline routing profile: the router reads it from a file
        profile = rd / f"routing-profile-{z.name}.yaml"
        profile.write_text(yaml.safe_dump(r.profile, sort_keys=False))
        flags += ["--policy-file", str(profile)]
    elif r.profile:
        flags += ["--policy-file", r.profile]
    if z.worker.engine == "vllm":  # the router checks token ids against the model's own vocabulary
        flags += ["--vocab-size", "0"]
    creds = auth.credentials()
    return start_service(
        "router",
        rd / "logs",
        *flags,
        timeout=120,
        credentials=creds,
        port=r.grpc_port,
        http_port=r.http_port,
        watch=watch,
    )


def _start_failover(
    s: SuiteSettings, z: ZoneSettings, rd: Path, auth: SuiteAuth, registry: Path, watch: StartWatch | None = None
) -> ServiceProcess:
    f = z.failover
    flags = [*_common(s, z, auth, f"failover-{z.name}"), "--registry-file", str(registry)]
    flags += ["--zones", ",".join(x.name for x in s.zones), "--health-interval-s", str(f.health_interval_s)]
    flags += ["--lkg-file", str(rd / f"lkg-{z.name}.json")]
    creds = auth.credentials()
    return start_service(
        "failover",
        rd / "logs",
        *flags,
        timeout=60,
        credentials=creds,
        port=f.grpc_port,
        http_port=f.http_port,
        watch=watch,
    )


def _start_planner(
    s: SuiteSettings, z: ZoneSettings, rd: Path, auth: SuiteAuth, router: str, watch: StartWatch | None = None
) -> ServiceProcess:
    """The zone's planner in dry-run: it reads its router's load and says what it would scale (metrics, log)."""
    p = z.planner
    flags = [*_common(s, z, auth, f"planner-{z.name}"), "--routers", f"{z.name}={router}", "--actuator", "dry-run"]
    flags += ["--interval-s", str(p.interval_s), "--per-worker-rps", str(p.per_worker_rps)]
    flags += ["--min-workers", str(p.min_workers), "--max-workers", str(p.max_workers), "--buffer", str(p.buffer)]
    flags += ["--lead-s", str(p.lead_s), "--history-file", str(rd / f"planner-history-{z.name}.json")]
    flags += ["--pools", "true"] if z.worker.disaggregated else []  # the prefill and decode pools sized apart
    return start_service(
        "planner",
        rd / "logs",
        *flags,
        timeout=60,
        credentials=auth.credentials(),
        port=p.grpc_port,
        http_port=p.http_port,
        watch=watch,
    )


def worker_roles(s: SuiteSettings) -> dict[str, str]:
    """Every worker's role by its service id (`worker-<zone>-<i>`), as `_start_worker` starts it."""
    return {f"worker-{z.name}-{i}": role.value for z in s.zones for i, role in enumerate(z.worker.roles())}


def _write_registry(path: Path, procs: list[ServiceProcess], roles: dict[str, str]) -> None:
    """The suite's static registry (the failover services' `--registry-file`), in the registry's own format;
    a worker's role (`roles`, by id) in its `worker_role` meta."""
    instances = []
    for p in procs:
        host, _, port = p.address.rpartition(":")
        zone = str(p.info.get("zone", "local"))
        meta = {"http": f"{HOST}:{p.info['http_port']}"}
        if p.info["id"] in roles:
            meta[WORKER_ROLE_META] = roles[p.info["id"]]
        instances.append(ServiceInstance(p.info["id"], Role(p.name), zone, "v1", host, int(port), meta=meta))
    write_catalog(path, CatalogSnapshot.of(instances))


def _start_redis(directory: Path, port: int) -> tuple[subprocess.Popen[bytes], str]:
    binary = shutil.which("redis-server")
    if binary is None:
        raise SystemExit("redis-server is not installed: run scripts/bootstrap.sh (or drop --redis)")
    if port == 0:
        port = free_port(HOST)
    directory.mkdir(parents=True, exist_ok=True)
    args = ["--port", str(port), "--bind", HOST, "--dir", str(directory), "--save", "", "--appendonly", "no"]
    proc = subprocess.Popen(
        [binary, *args], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True
    )
    if not redis_answers(HOST, port, 15.0, proc):
        proc.kill()
        raise SystemExit(f"redis-server did not start on port {port}")
    return proc, f"redis://{HOST}:{port}/0"


def redis_answers(host: str, port: int, timeout_s: float, proc: subprocess.Popen[bytes] | None = None) -> bool:
    """Whether the Redis at host:port answers PING within `timeout_s` (False at once if `proc`, its process,
    has exited)."""
    import redis

    client = redis.Redis(host=host, port=port, socket_timeout=1)
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            client.ping()
            return True
        except redis.RedisError:
            if time.monotonic() > deadline or (proc is not None and proc.poll() is not None):
                return False
            time.sleep(0.05)  # the start's poll interval
