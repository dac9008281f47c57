"""The local suite's settings: `kvmesh up [--config FILE] [--set KEY=VALUE]... [flags]`, typed, read once, pure.

The file has the shape of the Helm values (`deploy/helm/kvmesh/values.yaml`, one release per zone) and reuses
its key names (`model.blockSize`, `router.grpcPort`, `worker.replicas`, `worker.engine`, `tls.enabled`,
`auth.mode`, `redis.enabled` ...), plus what a local suite of several zones needs: `zones`, a list whose
entries are `{name, router?, cacheManager?, worker?, failover?, planner?}`, each section a partial override of the
top-level one (what a zone's own values file would say), and `ports`.

Prefill/decode disaggregation: `worker.prefillReplicas` and `worker.decodeReplicas` (`--prefill-workers`,
`--decode-workers`), per zone like every worker key, make the zone's workers that many `--role prefill` workers
then that many `--role decode` ones, in place of `worker.replicas` (which then reads as their sum); both 0 (the
default) is aggregated serving, `replicas` workers of role `both`. Prefill workers without a decode worker
are refused (nothing would take their handoffs), and so is a zone with prefill workers and no CPU tier
(`worker.cpuTierMb: 0`): a prefill worker hands its KV over from there (kv-sync). `docs/examples/` has complete files.

Resolution: defaults < file < `--set` < the named flags (`--workers`, `--engine`, ...); a named flag wins over
every zone's own value too. Ports: every service has a fixed default (`PORT_TABLE`); zone k adds
`k · ports.zoneStride` to every port its entry does not set itself, worker i adds i; `ports.auto: true`
(`--ports auto`) makes every port 0, a free one picked by each service, for suites started side by side.
A bad file is a `ConfigError` naming the key path, e.g. `zones[1].worker.replicas: expected int, got str`.
"""

from __future__ import annotations

import dataclasses
import re
import typing
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from kvmesh.core.handoff import WorkerRole

AUTO = 0  # the port of every service under `ports.auto`


class ConfigError(ValueError):
    """A bad setting: `path` is its key path (`zones[1].worker.replicas`), `message` what is wrong with it."""

    def __init__(self, path: str, message: str) -> None:
        super().__init__(f"{path}: {message}" if path else message)
        self.path, self.message = path, message


def _f(default: Any, **meta: Any) -> Any:
    """A setting's field: its default and its bounds (`min`, `max`), `choices`, `port` or `profile`."""
    return field(default=default, metadata=meta)


def _port(default: int) -> Any:
    return _f(default, port=True, min=0, max=65535)


@dataclass(frozen=True)
class ModelSettings:
    path: str = ""  # model folder of the workers and the router's tokenizer ("" = the tiny local model)
    name: str = ""  # served model name (/v1/models; "" = the folder's name)
    block_size: int = _f(32, min=1)
    salt: str = ""  # model string of the KV index hash salt (cache-manager --model, router --salt-model)
    tool_call_parser: str = ""  # the routers' --tool-call-parser (vLLM's parser names; "" = no "auto" tool calls)
    reasoning_parser: str = ""  # the routers' --reasoning-parser (vLLM's names; "" = reasoning stays in the text)


@dataclass(frozen=True)
class RouterSettings:
    grpc_port: int = _port(50051)
    http_port: int = _port(8000)  # OpenAI HTTP API, /metrics (as `vllm serve`)
    long_prompt_tokens: int = _f(2048, min=1)
    processes: int = _f(1, min=0)  # router processes sharing the router's ports (0 = one per core, at most 8)
    profile: str | dict[str, Any] | None = _f(None, profile=True)  # routing profile: a file path, or inline
    api_keys_file: str = ""  # client API keys (docs/security.md); "" = the suite's provisioned tokens only
    # output guardrail rules: a YAML file or a directory of them (docs/security.md), re-read when they change and
    # on `kvmesh guardrails --reload`; relative to the config file; "" = none
    guardrails: str = ""
    # router → worker requests: stream (one gRPC GenerateStream per worker, which a service mesh sees) or frames
    # (the opt-in fast path on the workers' frames port, opaque to a mesh: docs/operations.md)
    worker_transport: str = _f("stream", choices=("stream", "frames"))


@dataclass(frozen=True)
class CacheManagerSettings:
    grpc_port: int = _port(50052)
    http_port: int = _port(51052)
    checkpoint_interval_s: float = _f(30.0, min=0)
    # with several zones: each cache-manager follows the others and replicates its hot prefixes into them
    replication_bytes_per_s: float = _f(50e6, min=0)  # 0 = follow only, no replication


@dataclass(frozen=True)
class FailoverSettings:
    grpc_port: int = _port(50053)
    http_port: int = _port(51053)
    health_interval_s: float = _f(1.0, min=0.01)


@dataclass(frozen=True)
class WorkerSettings:
    replicas: int = _f(2, min=1, max=40)
    engine: str = _f("sim", choices=("sim", "vllm"))
    grpc_port: int = _port(50060)  # worker i: + i
    http_port: int = _port(51060)
    kv_sync_port: int = _port(52060)
    vllm_args: str = ""
    max_model_len: int = _f(4096, min=1)
    kv_blocks: int = _f(4096, min=1)  # sim engine
    sim_speed: float = _f(1.0, min=0)  # sim engine
    # prefill/decode disaggregation (the module docstring): workers of role prefill, then of role decode
    prefill_replicas: int = _f(0, min=0, max=40)
    decode_replicas: int = _f(0, min=0, max=40)
    cpu_tier_mb: float = _f(16.0, min=0)  # each worker's CPU tier (kv-sync), MiB; a prefill worker's handoffs

    @property
    def disaggregated(self) -> bool:
        """Whether the zone's workers have prefill/decode roles (else `replicas` workers of role both)."""
        return bool(self.prefill_replicas or self.decode_replicas)

    def roles(self) -> tuple[WorkerRole, ...]:
        """Worker i's role, for every worker of the zone: the prefill workers first, then the decode ones."""
        if not self.disaggregated:
            return (WorkerRole.BOTH,) * self.replicas
        return (WorkerRole.PREFILL,) * self.prefill_replicas + (WorkerRole.DECODE,) * self.decode_replicas


@dataclass(frozen=True)
class PlannerSettings:
    """The zone's planner, run in dry-run: it forecasts and says how many workers it would run
    (`kvmesh_planner_desired_workers`), starting and stopping none (docs/operations.md, "The planner")."""

    enabled: bool = True
    grpc_port: int = _port(50054)
    http_port: int = _port(51054)
    interval_s: float = _f(60.0, min=1)
    per_worker_rps: float = _f(0.2, min=0.001)  # capacity model: requests/s one worker serves within the SLO
    min_workers: int = _f(2, min=1)
    max_workers: int = _f(64, min=1)
    buffer: float = _f(0.2, min=0)
    lead_s: float = _f(1200.0, min=1)


@dataclass(frozen=True)
class TlsSettings:
    enabled: bool = False  # a development CA in run/pki, mTLS everywhere


@dataclass(frozen=True)
class AuthSettings:
    mode: str = _f("enforce", choices=("enforce", "auto", "off"))


@dataclass(frozen=True)
class TelemetrySettings:
    otlp_endpoint: str = ""
    log_format: str = _f("text", choices=("text", "json"))


@dataclass(frozen=True)
class RedisSettings:
    enabled: bool = False  # checkpoints in Redis: a local redis-server on `port`, or `url` when given
    url: str = ""
    port: int = _port(50050)


@dataclass(frozen=True)
class PortSettings:
    auto: bool = False
    zone_stride: int = _f(100, min=1)


@dataclass(frozen=True)
class ZoneSettings:
    """One zone, resolved: its name and its own sections."""

    name: str
    router: RouterSettings
    cache_manager: CacheManagerSettings
    worker: WorkerSettings
    failover: FailoverSettings
    planner: PlannerSettings

    def section(self, key: str) -> Any:
        """The section of a `ZONE_SECTIONS` key (`cacheManager` ...)."""
        return getattr(self, camel_to_snake(key))


@dataclass(frozen=True)
class SuiteSettings:
    zones: tuple[ZoneSettings, ...]
    version: str = "v1"
    log_level: str = _f("INFO", choices=("DEBUG", "INFO", "WARNING", "ERROR"))
    model: ModelSettings = ModelSettings()
    tls: TlsSettings = TlsSettings()
    auth: AuthSettings = AuthSettings()
    telemetry: TelemetrySettings = TelemetrySettings()
    redis: RedisSettings = RedisSettings()
    ports: PortSettings = PortSettings()
    zones_listed: bool = False  # the file gave `zones` (error paths then say zones[k].)


ZONE_SECTIONS: dict[str, type] = {
    "router": RouterSettings,
    "cacheManager": CacheManagerSettings,
    "worker": WorkerSettings,
    "failover": FailoverSettings,
    "planner": PlannerSettings,
}
GLOBAL_SECTIONS: dict[str, type] = {
    "model": ModelSettings,
    "tls": TlsSettings,
    "auth": AuthSettings,
    "telemetry": TelemetrySettings,
    "redis": RedisSettings,
    "ports": PortSettings,
}
SCALARS = {"version": str, "logLevel": str, "zone": str}
TOP_KEYS = (*SCALARS, "zones", *GLOBAL_SECTIONS, *ZONE_SECTIONS)
_ZONE_NAME = re.compile(r"^[a-z0-9]([a-z0-9-]{0,30}[a-z0-9])?$")


def camel(name: str) -> str:
    head, *rest = name.split("_")
    return head + "".join(part[:1].upper() + part[1:] for part in rest)


def _join(path: str, key: str | int) -> str:
    return f"{path}[{key}]" if isinstance(key, int) else (f"{path}.{key}" if path else key)


def _kind(value: Any) -> str:
    return {dict: "mapping", list: "list", type(None): "null"}.get(type(value), type(value).__name__)


def _check(value: Any, tp: Any, meta: Mapping[str, Any], path: str) -> Any:
    """`value` as type `tp`, within the field's bounds / choices, else a ConfigError at `path`."""
    if tp is float and isinstance(value, int) and not isinstance(value, bool):
        value = float(value)
    if not isinstance(value, tp) or (tp is not bool and isinstance(value, bool)):
        raise ConfigError(path, f"expected {tp.__name__}, got {_kind(value)} {value!r}")
    if "min" in meta and value < meta["min"]:
        raise ConfigError(path, f"must be >= {meta['min']}, got {value!r}")
    if "max" in meta and value > meta["max"]:
        raise ConfigError(path, f"must be <= {meta['max']}, got {value!r}")
    if "choices" in meta and value not in meta["choices"]:
        raise ConfigError(path, f"must be one of {', '.join(meta['choices'])}, got {value!r}")
    return value


def _profile(value: Any, path: str) -> Any:
    """A routing profile: a file path (str) or an inline profile mapping, checked by the profile's own parser."""
    if isinstance(value, str):
        return value
    if not isinstance(value, dict):
        raise ConfigError(path, f"expected a file path or a profile mapping, got {_kind(value)}")
    from kvmesh.routing.profile import Profile

    try:
        Profile.from_dict(value)
    except Exception as exc:  # the profile parser's own message names what is wrong
        raise ConfigError(path, f"bad routing profile: {exc}") from exc
    return value


def _section(cls: type[Any], raw: Any, path: str, base: Any = None) -> Any:
    """`cls` built from the mapping `raw` (over `base`'s values, else the defaults); unknown keys are errors."""
    if raw is None:
        raw = {}
    if not isinstance(raw, dict):
        raise ConfigError(path, f"expected a mapping, got {_kind(raw)}")
    fields = {camel(f.name): f for f in dataclasses.fields(cls)}
    for key in raw:
        if key not in fields:
            raise ConfigError(_join(path, str(key)), f"unknown key (known: {', '.join(fields)})")
    hints = typing.get_type_hints(cls)
    values = dataclasses.asdict(base) if base is not None else {}
    for key, f in fields.items():
        if key in raw:
            where = _join(path, key)
            meta = f.metadata
            values[f.name] = (
                _profile(raw[key], where) if meta.get("profile") else _check(raw[key], hints[f.name], meta, where)
            )
    return cls(**values)


def _zone(k: int, raw: Any, top: Mapping[str, Any], stride: int, auto: bool) -> ZoneSettings:
    path = f"zones[{k}]"
    if not isinstance(raw, dict):
        raise ConfigError(path, f"expected a mapping, got {_kind(raw)}")
    for key in raw:
        if key != "name" and key not in ZONE_SECTIONS:
            raise ConfigError(_join(path, str(key)), f"unknown key (known: name, {', '.join(ZONE_SECTIONS)})")
    if "name" not in raw:
        raise ConfigError(_join(path, "name"), "missing")
    name = _zone_name(raw["name"], _join(path, "name"))
    sections = {}
    for key, cls in ZONE_SECTIONS.items():
        own = raw.get(key) or {}
        obj = _section(cls, own, _join(path, key), top[key])
        shifted = {
            f.name: (AUTO if auto else getattr(obj, f.name) + (k * stride if camel(f.name) not in own else 0))
            for f in dataclasses.fields(cls)
            if f.metadata.get("port")
        }
        sections[key] = dataclasses.replace(obj, **shifted)
    return ZoneSettings(
        name,
        sections["router"],
        sections["cacheManager"],
        sections["worker"],
        sections["failover"],
        sections["planner"],
    )


def _worker_pools(w: WorkerSettings, path: str) -> WorkerSettings:
    """A disaggregated zone's workers checked (a decode pool, a CPU tier, at most `replicas`' bound) and
    counted: `replicas` becomes the prefill and decode workers' sum, which every port and identity follows."""
    if not w.disaggregated:
        return w
    if w.prefill_replicas and not w.decode_replicas:
        raise ConfigError(
            _join(path, "prefillReplicas"),
            f"{w.prefill_replicas} prefill worker(s) and no decode worker: a prefill worker only computes prompts"
            " for decode workers; add decode workers (worker.decodeReplicas, --decode-workers)",
        )
    if w.prefill_replicas and not w.cpu_tier_mb > 0:
        raise ConfigError(
            _join(path, "cpuTierMb"),
            "prefill workers hand their KV over from their CPU tier (kv-sync): must be > 0 in a zone with"
            " prefill workers",
        )
    most = _fields(WorkerSettings)["replicas"].metadata["max"]
    total = w.prefill_replicas + w.decode_replicas
    if total > most:
        raise ConfigError(
            _join(path, "prefillReplicas"), f"prefill and decode workers must be <= {most} in all, got {total}"
        )
    return dataclasses.replace(w, replicas=total)


def _zone_name(value: Any, path: str) -> str:
    name = _check(value, str, {}, path)
    if not _ZONE_NAME.match(name):
        raise ConfigError(path, f"a zone name is lower-case letters, digits and '-' (at most 32), got {name!r}")
    return str(name)


def parse(raw: Any) -> SuiteSettings:
    """The suite's settings from a loaded YAML document (None = every default)."""
    raw = {} if raw is None else raw
    if not isinstance(raw, dict):
        raise ConfigError("", f"the file must be a mapping, got {_kind(raw)}")
    for key in raw:
        if key not in TOP_KEYS:
            raise ConfigError(str(key), f"unknown key (known: {', '.join(TOP_KEYS)})")
    scalars = {k: _check(raw[k], tp, {}, k) for k, tp in SCALARS.items() if k in raw}
    glob = {k: _section(cls, raw.get(k), k) for k, cls in GLOBAL_SECTIONS.items()}
    top = {k: _section(cls, raw.get(k), k) for k, cls in ZONE_SECTIONS.items()}
    if "zone" in raw and "zones" in raw:
        raise ConfigError("zone", "give either zone (one zone) or zones (a list), not both")
    zones_raw = raw.get("zones", [{"name": scalars.get("zone", "local")}])
    if "zone" in raw:
        _zone_name(raw["zone"], "zone")
    if not isinstance(zones_raw, list) or not zones_raw:
        raise ConfigError("zones", f"expected a non-empty list, got {_kind(zones_raw)}")
    ports: PortSettings = glob["ports"]
    zones = tuple(_zone(k, z, top, ports.zone_stride, ports.auto) for k, z in enumerate(zones_raw))
    zones = tuple(
        dataclasses.replace(z, worker=_worker_pools(z.worker, f"zones[{k}].worker" if "zones" in raw else "worker"))
        for k, z in enumerate(zones)
    )
    seen: set[str] = set()
    for k, z in enumerate(zones):
        if z.name in seen:
            raise ConfigError(f"zones[{k}].name", f"zone {z.name!r} is listed twice")
        seen.add(z.name)
    log_level = _check(scalars.get("logLevel", "INFO"), str, _fields(SuiteSettings)["log_level"].metadata, "logLevel")
    redis = glob["redis"]
    if ports.auto:
        redis = dataclasses.replace(redis, port=AUTO)
    settings = SuiteSettings(zones, scalars.get("version", "v1"), log_level, glob["model"], glob["tls"], glob["auth"])
    settings = dataclasses.replace(
        settings, telemetry=glob["telemetry"], redis=redis, ports=ports, zones_listed="zones" in raw
    )
    plan(settings)  # overlapping ports are a bad file too
    return settings


def _fields(cls: type[Any]) -> dict[str, dataclasses.Field[Any]]:
    return {f.name: f for f in dataclasses.fields(cls)}


def load(path: Path | None, sets: typing.Sequence[str] = (), flags: Mapping[str, Any] | None = None) -> SuiteSettings:
    """Reads `path` (None: no file), applies `--set KEY=VALUE`s then the named flags (`{"worker.replicas": 3}`,
    None values skipped), and parses; a `router.profile` file (relative to the config file, else to the
    working directory) is read and checked too."""
    raw: Any = {}
    if path is not None:
        try:
            raw = yaml.safe_load(path.read_text())
        except OSError as exc:
            raise ConfigError("", f"cannot read {path}: {exc.strerror}") from exc
        except yaml.YAMLError as exc:
            raise ConfigError("", f"{path} is not YAML: {exc}") from exc
        raw = {} if raw is None else raw
    if not isinstance(raw, dict):
        raise ConfigError("", f"the file must be a mapping, got {_kind(raw)}")
    for item in sets:
        key, eq, text = item.partition("=")
        if not eq or not key:
            raise ConfigError("--set", f"expected KEY=VALUE, got {item!r}")
        try:
            value = yaml.safe_load(text)
        except yaml.YAMLError as exc:
            raise ConfigError(key, f"--set value is not YAML: {exc}") from exc
        assign(raw, key, value)
    flags = {k: v for k, v in (flags or {}).items() if v is not None}
    fixed = [FLAGS[k] for k in FLAGS if k in flags]
    if flags.get("ports.auto") and fixed:
        raise ConfigError("ports.auto", f"--ports auto picks every port: drop {' and '.join(fixed)}")
    for key, value in flags.items():
        override(raw, key, value)
    return _file_profiles(parse(raw), path.parent if path is not None else Path.cwd())


def _file_profiles(s: SuiteSettings, base: Path) -> SuiteSettings:
    """Every zone's `router.profile` file made absolute (relative to `base`, the config file's folder), read
    and checked by the profile parser: a missing or bad one is a ConfigError before anything starts."""

    def fix(k: int, z: ZoneSettings) -> ZoneSettings:
        z = _guardrails_path(k, z)
        p = z.router.profile
        if not isinstance(p, str) or not p:
            return z
        path = Path(p) if Path(p).is_absolute() else base / p
        where = f"zones[{k}].router.profile" if s.zones_listed else "router.profile"
        try:
            text = path.read_text()
        except OSError as exc:
            raise ConfigError(where, f"cannot read {path}: {exc.strerror}") from exc
        try:
            _profile(yaml.safe_load(text), where)
        except yaml.YAMLError as exc:
            raise ConfigError(where, f"{path} is not YAML: {exc}") from exc
        return dataclasses.replace(z, router=dataclasses.replace(z.router, profile=str(path)))

    def _guardrails_path(k: int, z: ZoneSettings) -> ZoneSettings:
        """`router.guardrails` made absolute (relative to `base`); a path that does not exist is a ConfigError."""
        g = z.router.guardrails
        if not g:
            return z
        path = Path(g) if Path(g).is_absolute() else base / g
        if not path.exists():
            where = f"zones[{k}].router.guardrails" if s.zones_listed else "router.guardrails"
            raise ConfigError(where, f"{path} does not exist (a rule file, or a directory of them)")
        return dataclasses.replace(z, router=dataclasses.replace(z.router, guardrails=str(path)))

    return dataclasses.replace(s, zones=tuple(fix(k, z) for k, z in enumerate(s.zones)))


_STEP = re.compile(r"([A-Za-z][A-Za-z0-9]*)|\[(\d+)\]")


def _steps(key: str) -> list[str | int]:
    steps: list[str | int] = []
    for part in key.split("."):
        matched = list(_STEP.finditer(part))
        if not part or "".join(m.group(0) for m in matched) != part or matched[0].group(1) is None:
            raise ConfigError(key, "not a key path (e.g. worker.replicas, zones[1].router.httpPort)")
        steps += [m.group(1) if m.group(1) else int(m.group(2)) for m in matched]
    return steps


def assign(raw: dict[str, Any], key: str, value: Any) -> None:
    """Sets the key path `key` of the raw document (`--set`), creating mappings on the way."""
    node: Any = raw
    steps = _steps(key)
    for i, step in enumerate(steps):
        last = i == len(steps) - 1
        where = key if last else "".join(f"[{s}]" if isinstance(s, int) else f".{s}" for s in steps[: i + 1])
        if isinstance(step, int):
            if not isinstance(node, list) or step >= len(node):
                raise ConfigError(where.lstrip("."), "no such list item in the file")
        elif not isinstance(node, dict):
            raise ConfigError(where.lstrip("."), f"cannot set a key inside a {_kind(node)}")
        if last:
            node[step] = value
        else:
            if isinstance(step, str) and not isinstance(node.get(step), dict | list):
                node[step] = {}
            node = node[step]


def override(raw: dict[str, Any], key: str, value: Any) -> None:
    """A named flag: sets `key` at the top level and removes it from every zone entry, so it wins everywhere."""
    section, _, leaf = key.partition(".")
    if key == "zone":
        zones = raw.get("zones")
        if isinstance(zones, list) and len(zones) > 1:
            raise ConfigError("zone", f"--zone names the one zone of a one-zone suite; the file lists {len(zones)}")
        if isinstance(zones, list) and zones and isinstance(zones[0], dict):
            zones[0]["name"] = value
            return
    assign(raw, key, value)
    for z in raw.get("zones") or []:
        if isinstance(z, dict) and leaf and isinstance(z.get(section), dict):
            z[section].pop(leaf, None)


# ---- the port plan -----------------------------------------------------------------------------------------


@dataclass(frozen=True)
class PlannedPort:
    port: int
    what: str  # "router HTTP (OpenAI API) of zone a"
    key: str  # the setting it comes from: "zones[1].router.httpPort" (+ i for worker i)
    flag: str  # the command-line flag that changes it


FLAGS = {"router.httpPort": "--http-port", "router.grpcPort": "--grpc-port"}
PORT_TABLE = (  # (service, kind, key, what) in start order; the documented defaults are the fields' defaults
    ("redis", "", "redis.port", "redis-server (with redis.enabled)"),
    ("cacheManager", "grpc", "cacheManager.grpcPort", "cache-manager gRPC"),
    ("cacheManager", "http", "cacheManager.httpPort", "cache-manager HTTP (/metrics)"),
    ("worker", "grpc", "worker.grpcPort", "worker gRPC"),
    ("worker", "http", "worker.httpPort", "worker HTTP (/metrics, OpenAI API)"),
    ("worker", "kvsync", "worker.kvSyncPort", "worker kv-sync"),
    ("router", "grpc", "router.grpcPort", "router gRPC"),
    ("router", "http", "router.httpPort", "router HTTP (OpenAI API, /metrics)"),
    ("failover", "grpc", "failover.grpcPort", "failover gRPC"),
    ("failover", "http", "failover.httpPort", "failover HTTP (/metrics)"),
    ("planner", "grpc", "planner.grpcPort", "planner gRPC (health)"),
    ("planner", "http", "planner.httpPort", "planner HTTP (/metrics)"),
)


def plan(s: SuiteSettings) -> list[PlannedPort]:
    """Every fixed port the suite will listen on (none under `ports.auto`); two services on one port, or a
    worker's port past 65535, is a ConfigError."""
    if s.ports.auto:
        return []
    out: list[PlannedPort] = []
    if s.redis.enabled and not s.redis.url:
        out.append(PlannedPort(s.redis.port, "redis-server", "redis.port", "--set redis.port=N"))
    for k, z in enumerate(s.zones):
        zone_path = f"zones[{k}]." if s.zones_listed else ""
        for service, _kind, key, what in PORT_TABLE[1:]:
            section = z.section(service)
            if not getattr(section, "enabled", True):  # a service the zone does not run listens on nothing
                continue
            attr = camel_to_snake(key.split(".")[1])
            base = getattr(section, attr)
            count = z.worker.replicas if service == "worker" else 1
            for i in range(count):
                label = f"{what} of zone {z.name}" if count == 1 else f"{what} {i} of zone {z.name}"
                path = zone_path + key + (f" + {i}" if service == "worker" else "")
                flag = FLAGS.get(key, f"--set {zone_path}{key}=N")
                out.append(PlannedPort(base + i, label, path, flag))
    by_port: dict[int, PlannedPort] = {}
    for p in out:
        if p.port > 65535:
            raise ConfigError(p.key, f"{p.what} would be port {p.port}, past 65535")
        if p.port in by_port:
            other = by_port[p.port]
            raise ConfigError(p.key, f"port {p.port} of {p.what} is also {other.what} ({other.key})")
        by_port[p.port] = p
    return out


def camel_to_snake(name: str) -> str:
    return re.sub(r"([A-Z])", lambda m: "_" + m.group(1).lower(), name)
