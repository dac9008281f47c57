"""Static registry: a YAML file, the embedded default when no Consul is configured.

File format::

    instances:
      - {id: router-a-1, role: router, zone: a, version: v1, address: 127.0.0.1, port: 50051,
         health: passing, capacity: 1}

`register`/`deregister` rewrite the file atomically under an ``flock`` on ``<file>.lock`` so that
several local processes can share it. The file is re-read when its (inode, size, mtime) changes;
`watch` polls that stat every `poll_s` seconds, at most ``ceil(wait_s / poll_s)`` times. The index
is local to this object and increases by one each time the parsed content changes. A file that
fails to parse (e.g. while an operator edits it) is ignored and the last good content kept.
Health is what the file says: the static registry runs no checks (the failover service wraps it in
`kvmesh.discovery.probing.ProbedRegistry`, which probes each instance).
"""

from __future__ import annotations

import asyncio
import contextlib
import fcntl
import logging
import math
import os
import tempfile
from collections.abc import Iterator
from pathlib import Path

import yaml

from kvmesh.core.errors import InvalidArgument, KvmeshError, NotFound
from kvmesh.discovery.model import CatalogSnapshot, ServiceInstance
from kvmesh.discovery.registry import CheckSpec, HealthProbe

log = logging.getLogger(__name__)


class StaticRegistry:
    """`Registry` over a YAML file (see the module docstring)."""

    def __init__(self, path: str | os.PathLike[str], poll_s: float = 0.1) -> None:
        self.path = Path(path)
        self.poll_s = poll_s
        self._stat: tuple[int, int, int] | None = None
        self._snap = CatalogSnapshot()
        self._index = 1
        self._refresh()

    # -- file access ---------------------------------------------------------------------------
    def _stat_key(self) -> tuple[int, int, int] | None:
        try:
            st = self.path.stat()
        except FileNotFoundError:
            return None
        return (st.st_ino, st.st_size, st.st_mtime_ns)

    def _read(self) -> CatalogSnapshot:
        if not self.path.exists():
            return CatalogSnapshot()
        data = yaml.safe_load(self.path.read_text()) or {}
        if not isinstance(data, dict) or not isinstance(data.get("instances", []), list):
            raise InvalidArgument("instances", f"{self.path}: expected a mapping with an 'instances' list")
        return CatalogSnapshot.from_json(data.get("instances") or [])

    def _refresh(self) -> bool:
        """Re-read the file if its stat changed; True when the parsed content changed."""
        key = self._stat_key()
        if key == self._stat:
            return False
        try:
            snap = self._read()
        except (KvmeshError, yaml.YAMLError, OSError) as e:
            log.warning("static registry %s unreadable, keeping last content: %s", self.path, e)
            return False
        self._stat = key
        if snap == self._snap:
            return False
        self._snap = snap
        self._index += 1
        return True

    @contextlib.contextmanager
    def _locked(self) -> Iterator[None]:
        self.path.parent.mkdir(parents=True, exist_ok=True)
        with open(f"{self.path}.lock", "a+") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)
            try:
                yield
            finally:
                fcntl.flock(lock, fcntl.LOCK_UN)

    def _write(self, snap: CatalogSnapshot) -> None:
        write_catalog(self.path, snap)

    # -- Registry ------------------------------------------------------------------------------
    async def register(
        self, instance: ServiceInstance, check: CheckSpec | None = None, probe: HealthProbe | None = None
    ) -> None:
        with self._locked():
            current = self._read().by_id()
            current[instance.id] = instance
            self._write(CatalogSnapshot.of(current.values()))
        self._refresh()

    async def deregister(self, instance_id: str) -> None:
        with self._locked():
            current = self._read().by_id()
            if current.pop(instance_id, None) is None:
                raise NotFound(f"instance {instance_id!r} is not registered")
            self._write(CatalogSnapshot.of(current.values()))
        self._refresh()

    async def snapshot(self) -> tuple[int, CatalogSnapshot]:
        self._refresh()
        return self._index, self._snap

    async def watch(self, index: int, wait_s: float) -> tuple[int, CatalogSnapshot]:
        self._refresh()
        polls = max(1, math.ceil(wait_s / self.poll_s))
        for _ in range(polls):
            if self._index > index or self._index < index:  # changed, or a foreign / reset index
                break
            await asyncio.sleep(self.poll_s)
            self._refresh()
        return self._index, self._snap

    async def close(self) -> None:
        return None


def write_catalog(path: Path, snap: CatalogSnapshot) -> None:
    """Writes `snap` to `path` in the file format above, atomically (a reader never sees half a file)."""
    body = yaml.safe_dump({"instances": snap.to_json()}, sort_keys=False)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.")
    with os.fdopen(fd, "w") as f:
        f.write(body)
    os.replace(tmp, path)
