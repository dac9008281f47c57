"""The worker's side of a kv-sync handoff (prefill/decode disaggregation, `kvmesh.core.handoff`).

A prefill half (`GenerateRequest.hand_off_ms`) runs as `prefill_only`; when it finishes and the engine handed
nothing over itself (vLLM's NIXL sets `EngineOutput.handoff`: forwarded unchanged), the worker hands the
prompt over by kv-sync: the prompt's leading full blocks its served tier holds (all but the block of the last
token, which the decode worker always computes), named as the tier names them (`PromptDigests`: the same
identities the decode worker derives from the prompt), are HELD: leased on the worker's own tier until
now + min(hand_off_ms, --handoff-hold-ms), so the tier cannot reuse those slots before the decode worker reads
them. The last response carries the `KvHandoff` whose `pull` the decode worker (through the router's
`kv_pull`) pulls by. A worker with no served tier, or an engine that cannot name its blocks, hands over
nothing (`num_blocks` 0): the decode worker computes the prompt.

A hold ends once, counted by outcome (`kvmesh_worker_handoffs_total`): `collected` when a peer's lease through
this worker's KvSyncService (`KvSyncServicer.on_lease`) ends at the hold's last block (the decode worker's
pull of that prompt: it asks for the blocks it lacks, up to the handed-over count), or `expired` when the hold
time passes first. Ending a hold lowers its slots' lease back to the latest lease anyone else has there
(another hold, a peer's lease), so collected blocks are reusable at once and nothing stays pinned past its
hold: a decode that never comes costs the tier those slots for the hold time, no longer.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import time
from collections import Counter, deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Protocol, runtime_checkable

from kvmesh.core.generation import EngineOutput, EngineRequest
from kvmesh.core.handoff import KvHandoff, WorkerRole
from kvmesh.core.pull import KvPull
from kvmesh.engine.base import Engine
from kvmesh.kvplane.kvsync.tier import RegionReader, SlotRef, StaleBlock, TierRegion
from kvmesh.rpc.validate import require
from kvmesh.services.worker import metrics as m
from kvmesh.v1 import worker_pb2

log = logging.getLogger(__name__)
# A prefill half's hold, at most: --handoff-hold-ms caps what is held; this refuses a value no router asks
MAX_HAND_OFF_MS = 600_000
COLLECTED = "collected"
EXPIRED = "expired"


def check_halves(request: worker_pb2.GenerateRequest, role: WorkerRole) -> None:
    """A disaggregated request's half on a worker that can run it: a prefill half (`hand_off_ms`) on a worker
    that prefills, a decode half (`handoff`) on one that decodes, never both at once; InvalidArgument naming
    the field otherwise."""
    if request.hand_off_ms:
        require(
            request.hand_off_ms <= MAX_HAND_OFF_MS,
            "hand_off_ms",
            f"must be at most {MAX_HAND_OFF_MS} ms, got {request.hand_off_ms}",
        )
        require(role.prefills, "hand_off_ms", f"this worker's role is {role.value}: it runs no prefill halves")
        require(
            not request.HasField("handoff"),
            "handoff",
            "a request is a prefill half (hand_off_ms) or a decode half (handoff), not both",
        )
    if request.HasField("handoff"):
        require(role.decodes, "handoff", f"this worker's role is {role.value}: it runs no decode halves")


@runtime_checkable
class PromptDigests(Protocol):
    """An engine that names a prompt's leading full blocks as its served tier does (the sim engine; a peer
    pulling the prompt derives the same identities)."""

    async def prompt_digests(self, req: EngineRequest) -> list[bytes]: ...


@dataclass(eq=False)
class Hold:
    """A prefill half's leading blocks (`digests`, in `refs`) leased on the tier until `until_ns`
    (`time.monotonic_ns`), i.e. `held_until_unix_ms`."""

    digests: tuple[bytes, ...]
    refs: tuple[SlotRef, ...]
    until_ns: int
    held_until_unix_ms: int
    timer: asyncio.TimerHandle | None = field(default=None, repr=False)

    @property
    def num_blocks(self) -> int:
        return len(self.refs)


def _wall_ms() -> float:
    return time.time() * 1000


class HandoffHolds:
    """The holds on one served tier region (`region_name` in kv-sync), their ends and their accounting.

    Runs on the worker's event loop, the thread its KvSyncServicer leases on (the region's lessor): every
    lease on the region is a hold's or one this observes (`observe_lease`), which is what lets a hold that
    ends lower its slots' lease to the latest other one (`TierRegion.release_leases`) without cutting anyone's
    short. Per held slot it keeps that floor: the lease found there when the first hold took it, raised by
    every peer lease since."""

    def __init__(
        self,
        region: TierRegion | RegionReader,
        region_name: str,
        max_hold_ms: int,
        clock_ns: Callable[[], int] = time.monotonic_ns,
        wall_ms: Callable[[], float] = _wall_ms,
    ) -> None:
        self.region = region
        self.region_name = region_name
        self.max_hold_ms = max_hold_ms
        self.clock_ns = clock_ns
        self.wall_ms = wall_ms
        self.outcomes: Counter[str] = Counter()
        self.collected_bytes = 0
        self._by_last: dict[bytes, deque[Hold]] = {}  # a hold's last digest -> the holds ending there, oldest first
        self._on_slot: dict[int, list[Hold]] = {}
        self._floor: dict[int, int] = {}  # held slot -> the latest lease end on it that is not a hold's

    @property
    def holds(self) -> int:
        """Holds not ended yet."""
        return sum(len(q) for q in self._by_last.values())

    def hold(self, digests: Sequence[bytes], hold_ms: int) -> Hold | None:
        """Leases the leading run of `digests` the region holds for min(hold_ms, max_hold_ms) and schedules
        the hold's expiry (on the running loop); None when nothing is held."""
        hold_ms = min(hold_ms, self.max_hold_ms)
        if hold_ms <= 0 or not digests:
            return None
        refs: list[SlotRef] = []
        for ref in self.region.locate(list(digests)):
            if ref is None:
                break
            refs.append(ref)
        if not refs:
            return None
        until_ns = self.clock_ns() + hold_ms * 1_000_000
        h = Hold(tuple(digests[: len(refs)]), tuple(refs), until_ns, int(self.wall_ms()) + hold_ms)
        for ref in refs:
            if ref.slot not in self._on_slot:
                self._floor[ref.slot] = self.region.lease_until(ref.slot)
            self._on_slot.setdefault(ref.slot, []).append(h)
        try:
            self.region.lease(refs, until_ns)
        except StaleBlock:  # the owner reused a slot as it was leased (a vLLM connector's region): hold up to it
            kept = next(i for i, r in enumerate(refs) if not self.region.unchanged(r))
            self._release(h, refs[kept:])
            if kept == 0:
                return None
            h.digests, h.refs = h.digests[:kept], h.refs[:kept]
        self._by_last.setdefault(h.digests[-1], deque()).append(h)
        self._schedule(h)
        m.observe_hold(h.num_blocks)
        return h

    def observe_lease(
        self, region_name: str, digests: Sequence[bytes], refs: Sequence[SlotRef | None], until_ns: int
    ) -> None:
        """A lease this worker's KvSyncService granted a peer (`KvSyncServicer.on_lease`): it raises the floor
        of the held slots it covers, and collects the oldest hold ending at the last block of its leading
        run (that is the decode worker's pull: it asks for the prompt's blocks up to the handed-over count)."""
        if region_name != self.region_name or not self._on_slot:
            return
        run: list[bytes] = []
        for digest, ref in zip(digests, refs, strict=True):
            if ref is None:
                break
            run.append(digest)
        for ref in refs:
            if ref is not None and ref.slot in self._floor:
                self._floor[ref.slot] = max(self._floor[ref.slot], until_ns)
        waiting = self._by_last.get(run[-1]) if run else None
        if waiting:
            h = waiting[0]
            leased = set(run)
            self._end(h, COLLECTED, sum(d in leased for d in h.digests) * self.region.block_bytes)

    def close(self) -> None:
        """Ends every hold as expired (the worker stops: no decode worker will collect them), leases left as
        they are (the region goes with the worker)."""
        for h in [h for q in self._by_last.values() for h in q]:
            self._end(h, EXPIRED, 0, release=False)

    def _schedule(self, h: Hold) -> None:
        delay_s = max(0.0, (h.until_ns - self.clock_ns()) / 1e9)
        h.timer = asyncio.get_running_loop().call_later(delay_s, self._expire, h)

    def _expire(self, h: Hold) -> None:
        if h.timer is None:
            return  # ended meanwhile
        if self.clock_ns() < h.until_ns:  # the loop's timer fired a little early: the lease still runs
            self._schedule(h)
            return
        self._end(h, EXPIRED, 0)

    def _end(self, h: Hold, outcome: str, collected_bytes: int, release: bool = True) -> None:
        if h.timer is not None:
            h.timer.cancel()
            h.timer = None
        waiting = self._by_last[h.digests[-1]]
        waiting.remove(h)
        if not waiting:
            del self._by_last[h.digests[-1]]
        if release:
            self._release(h, h.refs)
        else:
            self._forget(h, h.refs)
        self.outcomes[outcome] += 1
        self.collected_bytes += collected_bytes
        m.observe_hold_end(h.num_blocks, outcome, collected_bytes)
        log.debug("handoff hold of %d blocks ended: %s", h.num_blocks, outcome)

    def _release(self, h: Hold, refs: Sequence[SlotRef]) -> None:
        """Lowers the slots' lease from the hold's end to the latest other lease on each (when no later lease
        took them meanwhile), and forgets the hold there."""
        floors = []
        for ref in refs:
            floor = self._floor[ref.slot]
            for other in self._on_slot[ref.slot]:
                if other is not h and other.until_ns > floor:
                    floor = other.until_ns
            floors.append(floor)
        self.region.release_leases([r.slot for r in refs], h.until_ns, floors)
        self._forget(h, refs)

    def _forget(self, h: Hold, refs: Sequence[SlotRef]) -> None:
        for ref in refs:
            holders = self._on_slot[ref.slot]
            holders.remove(h)
            if not holders:
                del self._on_slot[ref.slot]
                del self._floor[ref.slot]


@dataclass(frozen=True, slots=True)
class HandoffSource:
    """Where a decode worker pulls this worker's handed-over blocks from (its GetInfo's fields)."""

    worker_id: str
    kvsync_address: str
    region: str
    shm_name: str


async def handed_over(
    engine: Engine, req: EngineRequest, out: EngineOutput, holds: HandoffHolds | None, source: HandoffSource
) -> EngineOutput:
    """A prefill half's output as it goes out: no tokens; the last one with its handoff, the engine's own when
    it set one, else the kv-sync one of the blocks `holds` holds for it (none: `num_blocks` 0)."""
    out = dataclasses.replace(out, token_ids=(), text="", logprobs=(), prompt_logprobs=())
    if not out.finished or out.handoff is not None:
        return out
    cached = out.usage.cached_tokens if out.usage is not None else 0
    h = None
    if holds is not None and isinstance(engine, PromptDigests):
        h = holds.hold(await engine.prompt_digests(req), req.hand_off_ms)
    if h is None:
        return dataclasses.replace(out, handoff=KvHandoff(source_worker_id=source.worker_id, cached_tokens=cached))
    pull = KvPull(
        source_address=source.kvsync_address,
        region=source.region,
        num_blocks=h.num_blocks,
        source_worker_id=source.worker_id,
        shm_name=source.shm_name,
        expires_unix_ms=h.held_until_unix_ms,
    )
    handoff = KvHandoff(h.num_blocks, h.held_until_unix_ms, source.worker_id, pull=pull, cached_tokens=cached)
    return dataclasses.replace(out, handoff=handoff)
