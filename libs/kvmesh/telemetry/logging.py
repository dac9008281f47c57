"""Logging set-up for every service: one format, the request id on every line, repeated records bounded.

Repeat limit: of the records sharing ``(logger, level, message template)`` (the template before its
arguments, so a client varying a field cannot evade it), the first `limit` per window of `window_s` seconds
(counted from the first of them) pass; the rest are dropped and counted in
``kvmesh_log_records_suppressed_total{logger,level}``. The first record after a window with drops ends is
preceded by one line ``suppressed N similar records in W s: <template>`` at the dropped records' level.
Defaults 5 per 60 s; services set them from `ServerSettings.log_repeat_limit` / `log_repeat_window_s` (flags
``--log-repeat-limit`` / ``--log-repeat-window-s``, or ``KVMESH_LOG_REPEAT_LIMIT`` / ``KVMESH_LOG_REPEAT_WINDOW_S``;
limit 0: no limit). A record logged with ``extra={UNLIMITED: True}`` is never limited (the audit log: every
admin action must have its line, `kvmesh.rpc.audit`).
"""

from __future__ import annotations

import json
import logging
import sys
import threading
from collections.abc import Hashable
from dataclasses import dataclass
from typing import Generic, TypeVar

from kvmesh.telemetry.context import request_id_var
from kvmesh.telemetry.metrics import LOG_RECORDS_SUPPRESSED

K = TypeVar("K", bound=Hashable)
REPEAT_LIMIT = 5
REPEAT_WINDOW_S = 60.0
MAX_TRACKED_KEYS = 10_000  # beyond this many distinct templates in a window, new ones pass untracked
_SUMMARY = "kvmesh_repeat_summary"  # LogRecord attribute marking a summary line (never limited itself)
UNLIMITED = "kvmesh_unlimited"  # LogRecord attribute of records the repeat limit must let through


@dataclass
class _Window:
    start: float
    seen: int


class RepeatLimiter(Generic[K]):
    """The repeat limit's decisions (module docstring), with the time passed in: no clock, no I/O."""

    def __init__(self, limit: int = REPEAT_LIMIT, window_s: float = REPEAT_WINDOW_S) -> None:
        self.limit = limit
        self.window_s = window_s
        self._windows: dict[K, _Window] = {}
        self._next_end = float("inf")  # earliest end of an open window: `expired` scans only after it

    def admit(self, key: K, now: float) -> bool:
        """True when the record with `key` at `now` passes; call `expired(now)` first."""
        w = self._windows.get(key)
        if w is None or now - w.start >= self.window_s:
            if w is None and len(self._windows) >= MAX_TRACKED_KEYS:
                return True
            self._windows[key] = _Window(now, 1)
            self._next_end = min(self._next_end, now + self.window_s)
            return True
        w.seen += 1
        return w.seen <= self.limit

    def expired(self, now: float) -> list[tuple[K, int]]:
        """Closes the windows ended by `now`; returns ``(key, records dropped)`` of those that dropped any."""
        if now < self._next_end:
            return []
        out: list[tuple[K, int]] = []
        for key, w in list(self._windows.items()):
            if now - w.start >= self.window_s:
                del self._windows[key]
                if w.seen > self.limit:
                    out.append((key, w.seen - self.limit))
        self._next_end = min((w.start + self.window_s for w in self._windows.values()), default=float("inf"))
        return out


class RepeatFilter(logging.Filter):
    """Handler filter applying a `RepeatLimiter` to records by ``(logger, level, template)``, at `record.created`."""

    def __init__(self, limiter: RepeatLimiter[tuple[str, int, str]]) -> None:
        super().__init__()
        self.limiter = limiter
        self._lock = threading.Lock()  # records arrive from gRPC's and aiohttp's threads alike

    def filter(self, record: logging.LogRecord) -> bool:
        if getattr(record, _SUMMARY, False) or getattr(record, UNLIMITED, False):
            return True
        with self._lock:
            ended = self.limiter.expired(record.created)
            ok = self.limiter.admit((record.name, record.levelno, str(record.msg)), record.created)
        for (name, level, template), dropped in ended:  # outside the lock: this logs through the same filter
            logging.getLogger(name).log(
                level,
                "suppressed %d similar records in %gs: %s",
                dropped,
                self.limiter.window_s,
                template,
                extra={_SUMMARY: True},
            )
        if not ok:
            LOG_RECORDS_SUPPRESSED.labels(record.name, record.levelname).inc()
        return ok


class _RequestIdFilter(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        record.request_id = request_id_var.get() or "-"
        return True


class _JsonFormatter(logging.Formatter):
    def format(self, record: logging.LogRecord) -> str:
        payload = {
            "ts": round(record.created, 3),
            "level": record.levelname,
            "logger": record.name,
            "request_id": getattr(record, "request_id", "-"),
            "msg": record.getMessage(),
        }
        if record.exc_info:
            payload["exc"] = self.formatException(record.exc_info)
        return json.dumps(payload)


def setup_logging(
    service: str,
    level: str = "INFO",
    fmt: str = "text",
    repeat_limit: int = REPEAT_LIMIT,
    repeat_window_s: float = REPEAT_WINDOW_S,
) -> None:
    """Configures the root logger once: text (`time level service [request id] logger: msg`) or JSON lines,
    with the repeat limit of the module docstring."""
    handler = logging.StreamHandler(sys.stderr)
    if repeat_limit > 0 and repeat_window_s > 0:
        handler.addFilter(RepeatFilter(RepeatLimiter(repeat_limit, repeat_window_s)))
    handler.addFilter(_RequestIdFilter())
    if fmt == "json":
        handler.setFormatter(_JsonFormatter())
    else:
        handler.setFormatter(
            logging.Formatter(f"%(asctime)s %(levelname)s {service} [%(request_id)s] %(name)s: %(message)s")
        )
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(level.upper())
    # Third-party chatter stays at WARNING unless DEBUG is asked for.
    if level.upper() != "DEBUG":
        for noisy in ("aiohttp.access", "grpc", "asyncio"):
            logging.getLogger(noisy).setLevel(logging.WARNING)
