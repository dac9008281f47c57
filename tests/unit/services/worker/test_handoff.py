"""A prefill half's hold on its worker's tier (`kvmesh.services.worker.handoff`): held slots are not reused;
a hold ends once, collected by a peer's lease through the worker's real KvSyncServicer or expired, and then
its slots are reusable (but a peer's or another hold's lease on them stays); the gauges and counters say so.
And the door: a half on a worker whose role does not run it, or an absurd hold, is refused naming the field."""

from __future__ import annotations

import asyncio
import time
import uuid
from collections.abc import Iterator

import pytest
from prometheus_client import REGISTRY

from kvmesh.core.errors import InvalidArgument
from kvmesh.core.generation import EngineOutput, EngineRequest, Usage
from kvmesh.core.handoff import KvHandoff, WorkerRole
from kvmesh.kvplane.kvsync.service import KvSyncServicer
from kvmesh.kvplane.kvsync.tier import TierRegion
from kvmesh.services.worker.handoff import (
    MAX_HAND_OFF_MS,
    HandoffHolds,
    HandoffSource,
    check_halves,
    handed_over,
)
from kvmesh.services.worker.servicer import WorkerServicer
from kvmesh.v1 import common_pb2, kvsync_pb2, worker_pb2
from kvmesh.wire.proto import request_from_proto

pytestmark = pytest.mark.unit
BB = 64
SLOTS = 6
DIGESTS = [bytes([i]) * 32 for i in range(1, 5)]  # a prompt's four leading blocks
SOURCE = HandoffSource("p1", "127.0.0.1:1", "cpu", "shm")


@pytest.fixture
def region() -> Iterator[TierRegion]:
    r = TierRegion.create(f"kvm-test-handoff-{uuid.uuid4().hex[:12]}", BB, SLOTS, "layout")
    for d in DIGESTS:
        assert r.put(d, d * 2, time.monotonic_ns())
    yield r
    r.close()


def metric(name: str, **labels: str) -> float:
    return REGISTRY.get_sample_value(name, labels) or 0.0


async def until(cond: object, timeout_s: float = 5.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not cond():  # type: ignore[operator]
        assert time.monotonic() < deadline, "condition not met in time"
        await asyncio.sleep(0.005)


def fill(region: TierRegion, start: int, n: int) -> int:
    """Puts `n` new blocks (LFU+LRU evicts the unleased ones first); how many found a slot."""
    return sum(region.put(bytes([start + i]) * 32, b"x", time.monotonic_ns()) for i in range(n))


async def test_an_uncollected_hold_expires_and_its_slots_are_reusable_then(region: TierRegion) -> None:
    holds = HandoffHolds(region, "cpu", max_hold_ms=10_000)
    expired0 = metric("kvmesh_worker_handoffs_total", outcome="expired")
    gauge0 = metric("kvmesh_worker_handoff_held_blocks")
    h = holds.hold([*DIGESTS, b"\x77" * 32], hold_ms=150)  # the tier holds the first four
    assert h is not None and h.num_blocks == 4 and h.digests == tuple(DIGESTS)
    assert abs(h.held_until_unix_ms - (time.time() * 1000 + 150)) < 100
    assert holds.holds == 1 and metric("kvmesh_worker_handoff_held_blocks") == gauge0 + 4
    # while held, a full tier evicts around the held slots (the two others take every new block)
    assert fill(region, 100, 8) == 8 and region.contains_prefix(DIGESTS) == 4
    await until(lambda: holds.holds == 0)
    assert holds.outcomes == {"expired": 1} and holds.collected_bytes == 0
    assert metric("kvmesh_worker_handoffs_total", outcome="expired") == expired0 + 1
    assert metric("kvmesh_worker_handoff_held_blocks") == gauge0
    assert fill(region, 120, 4) == 4  # the slots are reusable
    assert region.contains_prefix(DIGESTS) == 0


async def test_a_peer_lease_through_kvsync_collects_the_hold_and_keeps_its_own_lease(region: TierRegion) -> None:
    holds = HandoffHolds(region, "cpu", max_hold_ms=10_000)
    servicer = KvSyncServicer({"cpu": region}, on_lease=holds.observe_lease)
    bytes0 = metric("kvmesh_worker_handoff_bytes_total")
    h = holds.hold(DIGESTS, hold_ms=60_000)
    assert h is not None
    peer_ttl_ms = 300
    # the decode worker already has block 0: it leases the rest, up to the handed-over count
    req = kvsync_pb2.AcquireLeaseRequest(region="cpu", digests=DIGESTS[1:], ttl_ms=peer_ttl_ms)
    got = await servicer.AcquireLease(req, None)  # type: ignore[arg-type]
    assert all(b.found for b in got.blocks)
    assert holds.holds == 0 and holds.outcomes == {"collected": 1} and holds.collected_bytes == 3 * BB
    assert metric("kvmesh_worker_handoff_bytes_total") == bytes0 + 3 * BB
    # the hold's lease is gone at once (block 0: nobody else's), the peer's stays until it ends
    assert region.lease_until(h.refs[0].slot) < time.monotonic_ns()
    assert all(region.lease_until(r.slot) == got.lease_until_ns for r in h.refs[1:])
    assert fill(region, 100, 8) == 8 and region.contains_prefix(DIGESTS[:1]) == 0
    assert region.contains_prefix(DIGESTS[1:]) == 3
    await until(lambda: time.monotonic_ns() > got.lease_until_ns)
    assert fill(region, 120, 4) == 4 and region.contains_prefix(DIGESTS[1:]) == 0


async def test_one_lease_collects_one_hold_and_a_shorter_prefix_collects_none(region: TierRegion) -> None:
    holds = HandoffHolds(region, "cpu", max_hold_ms=10_000)
    first, second = holds.hold(DIGESTS, 5_000), holds.hold(DIGESTS, 8_000)
    shorter = holds.hold(DIGESTS[:2], 5_000)
    assert first and second and shorter and holds.holds == 3
    holds.observe_lease("cpu", DIGESTS, first.refs, time.monotonic_ns() + 1)  # a decode of the longer prompt
    assert holds.holds == 2 and holds.outcomes == {"collected": 1}
    assert region.lease_until(first.refs[3].slot) == second.until_ns  # the other hold on them stays
    holds.observe_lease("other-region", DIGESTS, first.refs, time.monotonic_ns() + 1)
    assert holds.holds == 2
    holds.close()
    assert holds.holds == 0 and holds.outcomes == {"collected": 1, "expired": 2}


async def test_no_hold_without_blocks_or_time(region: TierRegion) -> None:
    holds = HandoffHolds(region, "cpu", max_hold_ms=0)
    assert holds.hold(DIGESTS, 1000) is None  # --handoff-hold-ms 0: nothing is held
    holds = HandoffHolds(region, "cpu", max_hold_ms=1000)
    assert holds.hold([b"\x55" * 32, *DIGESTS], 1000) is None  # the tier lacks the first block
    assert holds.hold([], 1000) is None and holds.holds == 0


def half(**kw: object) -> worker_pb2.GenerateRequest:
    return worker_pb2.GenerateRequest(request_id="r", token_ids=common_pb2.TokenIds(ids=[1, 2]), **kw)  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("role", "kw", "field"),
    [
        (WorkerRole.DECODE, {"hand_off_ms": 1000}, "hand_off_ms"),
        (WorkerRole.BOTH, {"hand_off_ms": MAX_HAND_OFF_MS + 1}, "hand_off_ms"),
        (WorkerRole.PREFILL, {"handoff": worker_pb2.KvHandoff(pull=worker_pb2.KvPullHint(num_blocks=2))}, "handoff"),
        (WorkerRole.BOTH, {"hand_off_ms": 1000, "handoff": worker_pb2.KvHandoff(num_blocks=2)}, "handoff"),
    ],
)
def test_a_half_the_worker_does_not_run_is_refused_naming_the_field(
    role: WorkerRole, kw: dict[str, object], field: str
) -> None:
    with pytest.raises(InvalidArgument) as exc:
        check_halves(half(**kw), role)
    assert exc.value.field == field


def test_the_halves_each_role_runs_pass() -> None:
    check_halves(half(hand_off_ms=MAX_HAND_OFF_MS), WorkerRole.PREFILL)
    check_halves(half(hand_off_ms=1000), WorkerRole.BOTH)
    check_halves(half(handoff=worker_pb2.KvHandoff(num_blocks=2)), WorkerRole.DECODE)
    check_halves(half(), WorkerRole.PREFILL)


class Digesting:
    """Stands for an engine that names a prompt's blocks (the sim engine's `prompt_digests`)."""

    async def prompt_digests(self, req: EngineRequest) -> list[bytes]:
        return list(DIGESTS)


async def test_the_last_output_carries_the_kv_sync_handoff_and_no_tokens(region: TierRegion) -> None:
    holds = HandoffHolds(region, "cpu", max_hold_ms=2_000)
    req = EngineRequest("r", tuple(range(70)), prefill_only=True, hand_off_ms=5_000)
    mid = EngineOutput("r", token_ids=(9,), text="x")
    assert (await handed_over(Digesting(), req, mid, holds, SOURCE)).token_ids == ()  # type: ignore[arg-type]
    last = EngineOutput("r", (9,), "x", True, "prefill_only", Usage(70, 16, 0))
    out = await handed_over(Digesting(), req, last, holds, SOURCE)  # type: ignore[arg-type]
    h = out.handoff
    assert out.token_ids == () and out.text == "" and h is not None and h.pull is not None
    assert (h.num_blocks, h.source_worker_id, h.cached_tokens) == (4, "p1", 16)
    assert h.held_until_unix_ms - time.time() * 1000 <= 2_000  # --handoff-hold-ms caps the router's ask
    pull = (h.pull.source_address, h.pull.region, h.pull.shm_name, h.pull.num_blocks)
    assert pull == ("127.0.0.1:1", "cpu", "shm", 4)
    assert h.pull.expires_unix_ms == h.held_until_unix_ms and holds.holds == 1
    holds.close()
    # no tier served: the half still ends, handing over nothing (the decode worker computes the prompt)
    out = await handed_over(Digesting(), req, last, None, SOURCE)  # type: ignore[arg-type]
    assert out.handoff == KvHandoff(0, 0, "p1", cached_tokens=16)
    # an engine's own handoff (vLLM's NIXL) goes out unchanged, nothing held
    own = KvHandoff(3, 99, "p1", engine_params_json='{"remote_block_ids": [1]}')
    out = await handed_over(Digesting(), req, EngineOutput("r", finished=True, handoff=own), holds, SOURCE)  # type: ignore[arg-type]
    assert out.handoff is own and holds.holds == 0


def test_a_decode_half_loads_by_the_routers_kv_pull_else_by_its_handoffs_pull() -> None:
    handed = worker_pb2.KvHandoff(num_blocks=4, pull=worker_pb2.KvPullHint(source_address="p:1", num_blocks=4))
    alone = half(handoff=handed)
    pull = WorkerServicer._pull_of(alone, request_from_proto(alone))
    assert pull is not None and (pull.source_address, pull.num_blocks) == ("p:1", 4)
    routed = half(handoff=handed, kv_pull=worker_pb2.KvPullHint(source_address="r:1", num_blocks=3))
    pull = WorkerServicer._pull_of(routed, request_from_proto(routed))
    assert pull is not None and pull.source_address == "r:1"
    assert WorkerServicer._pull_of(half(), request_from_proto(half())) is None
