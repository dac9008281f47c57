"""Follows a `Registry` with blocking watches; serves the last known good snapshot when it fails.

Start-up: the persisted last-known-good record (if any) is published at once (``source =
"last-known-good"``), then the registry is read. Each successful watch marks the registry
reachable, publishes a changed snapshot and persists it. A failed watch (`Unavailable`, or any
error of the backend) marks it unreachable and keeps the current snapshot; retries back off as
``delay_k = min(retry_max_s, retry_min_s * 2**k)``. Consumers wait on `changed(version, timeout)`.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass

from kvmesh.core.changes import ChangeCounter
from kvmesh.core.errors import KvmeshError
from kvmesh.core.tasks import stop_task
from kvmesh.discovery.lkg import LastKnownGood, LkgRecord
from kvmesh.discovery.model import CatalogSnapshot
from kvmesh.discovery.registry import Registry

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class DiscoveryStatus:
    """Reachability report. `source`: "registry", "last-known-good" or "empty"."""

    reachable: bool | None
    source: str
    index: int
    version: int
    last_ok_at: float | None
    last_error: str | None
    unreachable_since: float | None


class DiscoveryWatcher:
    def __init__(
        self,
        registry: Registry,
        lkg: LastKnownGood | None = None,
        *,
        wait_s: float = 5.0,
        retry_min_s: float = 0.1,
        retry_max_s: float = 2.0,
        clock: Callable[[], float] = time.time,
    ) -> None:
        self.registry = registry
        self.lkg = lkg
        self.wait_s = wait_s
        self.retry_min_s = retry_min_s
        self.retry_max_s = retry_max_s
        self.clock = clock
        self.snapshot = CatalogSnapshot()
        self.index = 0
        self._changes = ChangeCounter()
        self.source = "empty"
        self.reachable: bool | None = None
        self.last_ok_at: float | None = None
        self.last_error: str | None = None
        self.unreachable_since: float | None = None
        self._task: asyncio.Task[None] | None = None

    def status(self) -> DiscoveryStatus:
        return DiscoveryStatus(
            self.reachable,
            self.source,
            self.index,
            self.version,
            self.last_ok_at,
            self.last_error,
            self.unreachable_since,
        )

    async def start(self) -> None:
        rec = self.lkg.load() if self.lkg else None
        if rec is not None:
            await self._publish(rec.snapshot, 0, "last-known-good")
            log.info(
                "serving last-known-good endpoints (%d instances) saved at %.3f",
                len(rec.snapshot.instances),
                rec.saved_at,
            )
        self._task = asyncio.create_task(self._run())

    async def stop(self) -> None:
        if self._task:
            await stop_task(self._task)
            self._task = None

    @property
    def version(self) -> int:
        """Bumped on every published snapshot or status change."""
        return self._changes.value

    async def changed(self, version: int, timeout_s: float) -> int:
        """Wait until the published version differs from `version` (or `timeout_s`); returns the current."""
        return await self._changes.wait_changed(version, timeout_s)

    async def _publish(self, snap: CatalogSnapshot, index: int, source: str) -> None:
        self.snapshot, self.index, self.source = snap, index, source
        self._changes.bump()

    async def _notify(self) -> None:
        self._changes.bump()

    async def _run(self) -> None:
        failures = 0
        while True:
            try:
                index, snap = await self.registry.watch(self.index, self.wait_s)
            except asyncio.CancelledError:
                raise
            except (KvmeshError, OSError, TimeoutError) as e:
                failures += 1
                now = self.clock()
                if self.reachable is not False:
                    self.unreachable_since = now
                    log.warning("registry unreachable, keeping %s endpoints: %s", self.source, e)
                self.reachable, self.last_error = False, str(e)
                self.index = 0  # re-read fully once it is back
                await self._notify()
                await asyncio.sleep(min(self.retry_max_s, self.retry_min_s * 2 ** min(failures - 1, 16)))
                continue
            failures = 0
            was_reachable = self.reachable
            self.reachable, self.last_ok_at, self.unreachable_since = True, self.clock(), None
            if snap != self.snapshot or self.source != "registry":
                await self._publish(snap, index, "registry")
                if self.lkg:
                    try:
                        self.lkg.save(LkgRecord(index, snap, self.clock()))
                    except OSError as e:
                        log.warning("could not persist last-known-good endpoints: %s", e)
            else:
                self.index = index
                if was_reachable is not True:
                    await self._notify()
