"""Logging set-up for every service: one format, the request id on every line."""

from __future__ import annotations

import json
import logging
import sys

from kvmesh.telemetry.context import request_id_var


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


def setup_logging(service: str, level: str = "INFO", fmt: str = "text") -> None:
    """Configures the root logger once: text (`time level service [request id] logger: msg`) or JSON lines."""
    handler = logging.StreamHandler(sys.stderr)
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
