"""Typed settings, read once at start-up from flags and `KVMESH_*` environment variables, then passed down.

A service declares a dataclass (fields with types, defaults and `help` metadata), usually extending
`ServerSettings`. `load_settings(cls, argv)` resolves every field as: command-line flag `--field-name`, else
`KVMESH_<SERVICE>_<FIELD>`, else `KVMESH_<FIELD>`, else the default. Bad values fail fast with a message
naming the flag and the variable. List settings are `tuple[str, ...]` (or of int/float), given as ``a,b`` or
as a YAML/JSON flow list ``[a, b]``, and their flags may be repeated (``--x a --x b,c`` = a, b, c); services
never split strings themselves.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import types
import typing
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, TypeVar

import yaml

from kvmesh.core.errors import InvalidArgument

T = TypeVar("T")


def setting(default: Any, help: str, **kwargs: Any) -> Any:
    """A dataclass field with help text (shown by `--help`)."""
    if isinstance(default, list | dict):
        return field(default_factory=lambda: type(default)(default), metadata={"help": help, **kwargs})
    return field(default=default, metadata={"help": help, **kwargs})


@dataclass(frozen=True)
class ServerSettings:
    """Settings every kvmesh service shares."""

    service_id: str = setting("", "unique id of this instance (default: <service>-<zone>-<port>)")
    host: str = setting("127.0.0.1", "address to bind the gRPC and HTTP servers to")
    port: int = setting(0, "gRPC port (0 = pick a free one)")
    http_port: int = setting(0, "HTTP port for /metrics, /healthz and HTTP APIs (0 = free one, -1 = off)")
    zone: str = setting("local", "availability zone of this instance")
    version: str = setting("v1", "version label, used by version traffic weights")
    log_level: str = setting("INFO", "log level")
    log_format: str = setting("text", "log format: text or json")
    event_loop: str = setting("asyncio", "the event loop: asyncio or uvloop (libuv's)")
    gc_freeze: bool = setting(
        True, "once serving, keep the start-up heap out of the garbage collector's full passes (gc.freeze)"
    )
    log_repeat_limit: int = setting(5, "identical log records let through per window (0 = no limit)")
    log_repeat_window_s: float = setting(60.0, "window of the repeated-log-record limit, seconds")
    otlp_endpoint: str = setting("", "OTLP/gRPC endpoint for traces (empty = no export)")
    tls_cert: str = setting("", "server certificate (PEM); enables TLS on the gRPC and the HTTP ports")
    tls_key: str = setting("", "server private key (PEM)")
    tls_client_ca: str = setting("", "CA (PEM) that client certificates must chain to; enables mTLS")
    tls_ca: str = setting("", "CA (PEM) to verify the servers this service calls; enables TLS on outbound calls")
    tls_client_cert: str = setting("", "client certificate (PEM) for outbound mTLS")
    tls_client_key: str = setting("", "client private key (PEM) for outbound mTLS")
    auth_mode: str = setting(
        "auto",
        "authorisation table (docs/security.md): auto = enforced when this server has an identity source "
        "(auth_tokens_file or mTLS); enforce = always; off = anyone may call anything",
    )
    auth_tokens_file: str = setting("", "YAML file of the bearer tokens this server accepts and their identities")
    auth_token_file: str = setting("", "file holding this process's own bearer token, sent on its outbound calls")
    auth_clients_generate: bool = setting(
        False, "clients (role client) may call a worker's Generate/GenerateStream/Abort and OpenAI routes directly"
    )
    grace_s: float = setting(10.0, "seconds to drain in-flight calls on SIGTERM")
    ready_file: str = setting("", "write bound ports as JSON here once serving (used by tests and `kvmesh up`)")
    registry_file: str = setting("", "static registry YAML (embedded default discovery)")
    consul_url: str = setting("", "Consul agent HTTP address; enables Consul registration")
    advertise_address: str = setting("", "host:port peers reach this gRPC server at (default: host:bound port)")
    reuse_port: bool = setting(False, "share the gRPC and HTTP ports with other processes (SO_REUSEPORT)")
    process_http_port: int = setting(
        -1, "a second HTTP port of this process alone, e.g. its own /metrics when processes share a port (-1 = none)"
    )
    plain_http_port: int = setting(
        -1,
        "with TLS, a plaintext HTTP port serving only /healthz and /metrics, for probes and scrapers that speak "
        "no TLS (0 = a free one, -1 = none: HTTPS only)",
    )


EVENT_LOOPS = ("asyncio", "uvloop")


def key_map(field: str, items: Sequence[str], what: str) -> dict[str, str]:
    """``('a=X', 'b=Y')`` → {a: X, b: Y}, each key once; InvalidArgument naming ``field`` (``what`` names the
    entry's shape in the message: ``zone=host:port``)."""
    out: dict[str, str] = {}
    for item in items:
        key, sep, value = item.partition("=")
        if not sep or not key or not value:
            raise InvalidArgument(field, f"entry {item!r}: expected {what}")
        if key in out:
            raise InvalidArgument(field, f"{key!r} given twice")
        out[key] = value
    return out


def _flag(name: str) -> str:
    return "--" + name.replace("_", "-")


def _parse_bool(text: str) -> bool:
    lowered = text.strip().lower()
    if lowered in ("1", "true", "yes", "on"):
        return True
    if lowered in ("0", "false", "no", "off", ""):
        return False
    raise ValueError(f"not a boolean: {text!r}")


def _list_items(text: str) -> list[str]:
    """The items of ``a,b`` or of a YAML/JSON flow list ``[a, b]`` (blank items dropped)."""
    stripped = text.strip()
    if stripped.startswith("["):
        try:
            items = yaml.safe_load(stripped)
        except yaml.YAMLError as exc:
            raise ValueError(f"not a YAML list: {exc}") from exc
        if not isinstance(items, list):
            raise ValueError(f"not a list: {text!r}")
        return [str(i).strip() for i in items if str(i).strip()]
    return [part.strip() for part in stripped.split(",") if part.strip()]


def _converter(tp: Any) -> Any:
    origin = typing.get_origin(tp)
    if origin in (typing.Union, types.UnionType):
        args = [a for a in typing.get_args(tp) if a is not type(None)]
        inner = _converter(args[0])
        return lambda text: None if text in ("", "none", "None") else inner(text)
    if origin in (list, tuple):
        item = typing.get_args(tp)[0]
        inner = _converter(item)
        return lambda text: origin(inner(part) for part in _list_items(text))
    if tp is bool:
        return _parse_bool
    if tp in (int, float, str):
        return tp
    raise TypeError(f"unsupported settings type {tp!r}")


def load_settings(
    cls: type[T], argv: Sequence[str] | None = None, env: Mapping[str, str] | None = None, service: str = ""
) -> T:
    """Builds `cls` from flags (argv), then env (`KVMESH_<SERVICE>_<FIELD>`, `KVMESH_<FIELD>`), then defaults."""
    env = os.environ if env is None else env
    hints = typing.get_type_hints(cls)
    parser = argparse.ArgumentParser(
        prog=f"kvmesh-{service}" if service else None, description=(cls.__doc__ or "").strip()
    )
    for f in dataclasses.fields(cls):  # type: ignore[arg-type]
        repeatable = typing.get_origin(hints[f.name]) in (list, tuple)  # a list flag may be given more than once
        action = "append" if repeatable else "store"
        parser.add_argument(_flag(f.name), dest=f.name, default=None, action=action, help=f.metadata.get("help", ""))
    parsed = parser.parse_args(list(argv) if argv is not None else None)
    values: dict[str, Any] = {}
    prefix = f"KVMESH_{service.upper().replace('-', '_')}_" if service else None
    for f in dataclasses.fields(cls):  # type: ignore[arg-type]
        raw: str | list[str] | None = getattr(parsed, f.name)
        source = _flag(f.name)
        if raw is None and prefix and (prefix + f.name.upper()) in env:
            source = prefix + f.name.upper()
            raw = env[source]
        if raw is None and ("KVMESH_" + f.name.upper()) in env:
            source = "KVMESH_" + f.name.upper()
            raw = env[source]
        if raw is None:
            continue
        try:
            convert = _converter(hints[f.name])
            if isinstance(raw, list):  # a repeated list flag: each occurrence's items, in order
                values[f.name] = typing.get_origin(hints[f.name])(x for r in raw for x in convert(r))
            else:
                values[f.name] = convert(raw)
        except (ValueError, TypeError) as exc:
            parser.error(f"{source}: invalid value {raw!r} for {f.name}: {exc}")
    try:
        return cls(**values)
    except InvalidArgument as exc:  # a settings class's own check (__post_init__): one line naming the flag
        parser.error(f"{_flag(exc.field)}: {str(exc).removeprefix(exc.field + ': ')}")
