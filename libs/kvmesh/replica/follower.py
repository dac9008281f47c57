"""Following a cache-manager's WatchIndex stream into a `ReplicaIndex`, resumed after every break.

One loop for every follower (the router's index replica, a cache-manager following another zone's):

1. Before each stream, the followed cache-manager's block size and hash salt model (`GetStats`) are checked
   against `expect`; one that disagrees is not followed (`disagreement` says why) until it agrees.
2. `WatchIndex` with the resume point of the copy (its revision and epoch, when `resume` and it has one):
   the cache-manager answers with only the missed deltas (`resumed`) or with a snapshot.
3. Every message is applied; a live message must be the next revision (the stream follows every worker),
   else the copy is behind something it did not see (e.g. it was restored from a checkpoint) and the
   stream is reopened from its revision.
4. On a break: the copy is kept as the resume point, `connected` is false, and the loop reconnects after a
   back-off (50 ms doubling to 2 s, reset by every applied message); the channel's own reconnection back-off
   is capped at 2 s too (gRPC's default grows to 120 s: a long partition would heal minutes late).

`on_message(msg, first, lag_s)` sees each applied message, whether it is its stream's first, and its lag
(apply time − the cache-manager's `ingested_at`, wall clocks; None for snapshot messages).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable, Sequence
from typing import Any

import grpc

from kvmesh.core.errors import FailedPrecondition
from kvmesh.core.tasks import stop_task
from kvmesh.replica.index import ReplicaIndex
from kvmesh.rpc.agreement import Agreed, require_agreement
from kvmesh.rpc.channel import CHANNEL_OPTIONS, ChannelSecurity, open_channel
from kvmesh.v1 import cache_manager_pb2 as pb
from kvmesh.v1 import cache_manager_pb2_grpc

log = logging.getLogger(__name__)
RECONNECT = [
    ("grpc.initial_reconnect_backoff_ms", 100),
    ("grpc.min_reconnect_backoff_ms", 100),
    ("grpc.max_reconnect_backoff_ms", 2000),
]
OnMessage = Callable[[pb.WatchIndexResponse, bool, "float | None"], None]


class RevisionGap(Exception):
    """A live message that is not the copy's next revision."""


class IndexFollower:
    """Keeps `replica` equal to the index of the cache-manager at `address` ('' = none; see module docstring)."""

    def __init__(
        self,
        address: str,
        security: ChannelSecurity,
        expect: tuple[int, str] | None = None,
        replica: ReplicaIndex | None = None,
        resume: bool = True,
        on_message: OnMessage | None = None,
        channel_options: Sequence[tuple[str, Any]] = CHANNEL_OPTIONS,
    ) -> None:
        self.address = address
        self.security = security
        self.expect = expect  # (block size, salt model) the cache-manager must have; None = no check
        self.replica = replica if replica is not None else ReplicaIndex()
        self.resume = resume
        self.on_message = on_message
        self.channel_options = channel_options
        self.disagreement = ""  # why the cache-manager is not followed ('' = it agrees or is unchecked)
        self.connected = False  # a stream is open and its snapshot or resume is complete
        self.snapshots = self.resumes = 0  # streams started each way
        self.last_lag_s = 0.0
        self.synced = asyncio.Event()  # set once the copy is first complete
        self.updated = asyncio.Event()  # set after every applied message (tests and metrics wait on it)
        self._channel: grpc.aio.Channel | None = None
        self.stub: cache_manager_pb2_grpc.CacheManagerServiceStub | None = None
        self._open()
        self._task: asyncio.Task[None] | None = None
        self._started = False

    def _open(self) -> None:
        opts = [*self.channel_options, *RECONNECT]
        self._channel = open_channel(self.address, self.security, options=opts) if self.address else None
        self.stub = cache_manager_pb2_grpc.CacheManagerServiceStub(self._channel) if self._channel else None

    def start(self) -> None:
        self._started = True
        if self.stub is not None:
            self._task = asyncio.create_task(self._follow(), name=f"follow-{self.address}")

    async def _close(self) -> None:
        await stop_task(self._task)
        self._task = None
        if self._channel is not None:
            await self._channel.close()
        self.connected = False

    async def retarget(self, address: str) -> None:
        """Follow another cache-manager: the copy starts again from its snapshot."""
        if address == self.address:
            return
        await self._close()
        self.address, self.disagreement = address, ""
        self.replica.reset()
        self.synced.clear()
        self._open()
        if self._started:
            self.start()

    async def stop(self) -> None:
        await self._close()

    def _pairs(self, stats: pb.GetStatsResponse) -> list[Agreed]:
        assert self.expect is not None
        block_size, salt_model = self.expect
        return [
            Agreed("--block-size", block_size, stats.block_size, unknown=stats.block_size == 0),
            Agreed("--salt-model (cache-manager --model)", salt_model, stats.model),
        ]

    async def check_agreement(self, timeout_s: float = 5.0) -> None:
        """Raises FailedPrecondition if the cache-manager disagrees with `expect`; an unreachable one passes
        (it is checked again before every stream)."""
        if self.stub is None or self.expect is None:
            return
        try:
            stats = await self.stub.GetStats(pb.GetStatsRequest(), timeout=timeout_s)
        except grpc.aio.AioRpcError as e:
            log.warning("cache-manager %s not reachable for the settings check: %s", self.address, e.code().name)
            return
        require_agreement(f"cache-manager {self.address}", self._pairs(stats))

    async def _agrees(self) -> bool:
        """Checks the cache-manager before a stream; a disagreement is logged once and keeps it unfollowed."""
        try:
            await self.check_agreement(timeout_s=2.0)
        except FailedPrecondition as e:
            if e.message != self.disagreement:
                log.error("not following the cache-manager: %s", e.message)
            self.disagreement = e.message
            return False
        self.disagreement = ""
        return True

    def request(self) -> pb.WatchIndexRequest:
        """The stream's request: the copy's resume point when it has one."""
        r = self.replica
        if self.resume and r.epoch:
            return pb.WatchIndexRequest(resume_revision=r.revision, resume_epoch=r.epoch)
        return pb.WatchIndexRequest()

    def apply(self, msg: pb.WatchIndexResponse, first: bool) -> None:
        """One message of the stream (`first`: its first), checked for a revision gap, then applied."""
        r = self.replica
        if first:
            if msg.resumed:
                self.resumes += 1
            else:
                self.snapshots += 1
        elif not msg.snapshot and r.complete and msg.revision != r.revision + 1:
            raise RevisionGap(f"revision {msg.revision} after {r.revision}")
        r.apply(msg)
        lag = None
        if msg.ingested_at > 0 and not msg.snapshot:
            lag = self.last_lag_s = max(0.0, time.time() - msg.ingested_at)
        if r.complete:
            self.connected = True
            self.synced.set()
        if self.on_message is not None:
            self.on_message(msg, first, lag)
        self.updated.set()

    async def _follow(self) -> None:
        assert self.stub is not None
        backoff = 0.05
        while True:
            try:
                if not await self._agrees():
                    raise FailedPrecondition(self.disagreement)
                first = True
                async for msg in self.stub.WatchIndex(self.request()):
                    self.apply(msg, first)
                    first = False
                    backoff = 0.05
            except asyncio.CancelledError:
                raise
            except grpc.aio.AioRpcError as e:
                log.info("index watch of %s ended: %s", self.address, e.code().name)
            except RevisionGap as e:
                log.info("index watch of %s: %s, resuming", self.address, e)
            except FailedPrecondition:
                pass  # logged by _agrees; checked again after the back-off
            except Exception:
                log.exception("index watch of %s failed", self.address)
            self.connected = False
            self.replica.interrupted()
            self.updated.set()
            await asyncio.sleep(backoff)
            backoff = min(backoff * 2, 2.0)
