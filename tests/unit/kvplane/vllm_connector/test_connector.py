"""`KvmeshConnector` with vLLM's config and connector base but fake requests / scheduler outputs, real
shared-memory tier regions and real torch KV tensors: saves, peer pulls, own-tier loads, and every load
failure (corrupt byte, reused slot, region gone) reported as failed blocks; no claim on an expired lease,
a foreign layout or digests the hint does not offer. Asynchronous loads (the request waits, the copies run
on the tier I/O thread, `get_finished` reports it with its failures), a lease that ends before the copy,
saves published in the background with the request's blocks held until they are done. Tier events: real
vLLM `Request`s (vLLM's block hasher) and vLLM's own `BlockPool` for the GPU events they are compared with
and ingested beside."""

from __future__ import annotations

import os
import threading
import time
import uuid
from collections.abc import Iterator
from types import SimpleNamespace
from typing import Any

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("vllm")

from vllm.config import KVTransferConfig  # noqa: E402
from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole  # noqa: E402

from kvmesh.kvplane.kvsync.tier import SHM_DIR, RegionReader, data_offset  # noqa: E402
from kvmesh.kvplane.vllm_connector.connector import (  # noqa: E402
    DEFAULT_IO_NICE,
    ConnectorSettings,
    KvmeshConnector,
    KvmeshMetadata,
    _Job,
)
from kvmesh.kvplane.vllm_connector.layout import block_digests  # noqa: E402
from kvmesh.kvplane.vllm_connector.plan import PULL_KEY  # noqa: E402

BS = 4
LAYERS, HEADS, HEAD = 2, 2, 32
NUM_BLOCKS = 16
PROMPT = [3 + (7 * i) % 50 for i in range(5 * BS + 1)]  # 5 full blocks + 1 token: 5 loadable


class FakeModelConfig:
    model = "tiny"
    dtype = torch.bfloat16

    def get_num_layers(self, pc: Any) -> int:
        return LAYERS

    def get_num_kv_heads(self, pc: Any) -> int:
        return HEADS

    def get_head_size(self) -> int:
        return HEAD


def vllm_config(shm_name: str, model: str = "tiny", **extra: Any) -> Any:
    mc = FakeModelConfig()
    mc.model = model
    ktc = KVTransferConfig(
        kv_connector="KvmeshConnector",
        kv_connector_module_path="kvmesh.kvplane.vllm_connector.connector",
        kv_role="kv_both",
        kv_load_failure_policy="recompute",
        kv_connector_extra_config={"shm_name": shm_name, "tier_bytes": 64 * 2048, **extra},
    )
    return SimpleNamespace(
        model_config=mc,
        parallel_config=SimpleNamespace(rank=0, tensor_parallel_size=1),
        cache_config=SimpleNamespace(block_size=BS, cache_dtype="auto"),
        kv_transfer_config=ktc,
        kv_events_config=SimpleNamespace(enable_kv_cache_events=True),
    )


class Engine:
    """One engine's two connector halves and its paged KV tensors (synchronous loads unless `load_async`)."""

    def __init__(self, model: str = "tiny", load_async: bool = False, save_async: bool = True, **extra: Any) -> None:
        self.shm_name = f"kvmesh-ut-{uuid.uuid4().hex[:12]}"
        self.load_async = load_async
        cfg = vllm_config(self.shm_name, model, load_async=load_async, save_async=save_async, **extra)
        self.sched = KvmeshConnector(cfg, KVConnectorRole.SCHEDULER, None)
        self.worker = KvmeshConnector(cfg, KVConnectorRole.WORKER, None)
        self.kv = {
            f"layer.{i}": torch.zeros(NUM_BLOCKS, HEADS, BS, 2 * HEAD, dtype=torch.bfloat16) for i in range(LAYERS)
        }
        self.worker.register_kv_caches(self.kv)
        self.failed: set[int] = set()

    def block(self, block_id: int) -> list[Any]:
        return [self.kv[f"layer.{i}"][block_id].clone() for i in range(LAYERS)]

    def step(self, rid: str, block_ids: list[int], num_computed: int, num_scheduled: int) -> KvmeshMetadata:
        """One engine step for a new request: metadata, loads before the 'forward', saves after it."""
        out = SimpleNamespace(
            scheduled_new_reqs=[SimpleNamespace(req_id=rid, block_ids=(block_ids,), num_computed_tokens=num_computed)],
            num_scheduled_tokens={rid: num_scheduled},
            scheduled_cached_reqs=SimpleNamespace(
                req_ids=[], resumed_req_ids=set(), new_block_ids=[], num_computed_tokens=[]
            ),
        )
        meta = self.sched.build_connector_meta(out)
        assert isinstance(meta, KvmeshMetadata)
        self.worker.bind_connector_metadata(meta)
        self.worker.start_load_kv(None)  # type: ignore[arg-type]
        return meta

    def finish_step(self) -> None:
        """The step's end: saves handed to the tier I/O thread, then (for the test) waited for."""
        self.worker.wait_for_save()
        self.worker.clear_connector_metadata()
        self.drain()

    def drain(self) -> None:
        """Waits until the tier I/O thread has run everything queued so far."""
        assert self.worker._io is not None
        self.worker._io.run(_Job())

    def schedule(self, req: Any, block_ids: list[int] | None = None) -> int:
        """The scheduler's calls for a new request with no vLLM prefix hit: tokens claimed (an asynchronous
        claim gets `block_ids` allocated at once, as vLLM allocates before it parks the request)."""
        n, is_async = self.sched.get_num_new_matched_tokens(req, 0)
        assert n is not None and is_async == (self.load_async and n > 0)
        blocks = SimpleNamespace(get_block_ids=lambda: (list(block_ids or []),))
        self.sched.update_state_after_alloc(req, blocks, n)  # type: ignore[arg-type]
        return n

    def close(self) -> None:
        self.worker.shutdown()
        self.sched.shutdown()


def request(rid: str, params: dict[str, Any] | None = None, tokens: list[int] = PROMPT) -> Any:
    return SimpleNamespace(
        request_id=rid,
        prompt_token_ids=list(tokens),
        all_token_ids=list(tokens),
        num_prompt_tokens=len(tokens),
        num_tokens=len(tokens),
        lora_request=None,
        cache_salt=None,
        kv_transfer_params=params,
        block_hashes=[],  # no vLLM hashes: no tier events for these
    )


def hint(eng: Engine, lease_s: float = 30.0, digests: list[bytes] | None = None) -> dict[str, Any]:
    h: dict[str, Any] = {"shm_name": eng.shm_name, "lease_until_ns": time.monotonic_ns() + int(lease_s * 1e9)}
    if digests is not None:
        h["digests"] = [d.hex() for d in digests]
    return {PULL_KEY: h}


@pytest.fixture
def engines() -> Iterator[tuple[Engine, Engine]]:
    a, b = Engine(), Engine()
    try:
        yield a, b
    finally:
        a.close()
        b.close()


def compute_on(eng: Engine, rid: str = "a1") -> None:
    """A computes PROMPT in blocks 0..5 (the 'forward' writes random KV) and saves its 5 full blocks."""
    assert eng.schedule(request(rid)) == 0
    meta = eng.step(rid, list(range(6)), 0, len(PROMPT))
    assert meta.loads == [] and len(meta.saves) == 5
    torch.manual_seed(0)
    for t in eng.kv.values():
        t[:6].copy_(torch.randn(6, HEADS, BS, 2 * HEAD, dtype=torch.bfloat16))
    eng.finish_step()
    assert eng.worker.counts["saved"] == 5


def digests_of(eng: Engine) -> list[bytes]:
    return block_digests(PROMPT, eng.sched.layout)


def flip_byte(eng: Engine, digest: bytes) -> None:
    """Corrupts one data byte of a held block (TIER_API.md's slot layout)."""
    reader = RegionReader.attach(eng.shm_name)
    (ref,) = reader.locate([digest])
    assert ref is not None
    pos = data_offset(reader.num_slots) + ref.slot * reader.block_bytes + 7
    reader.close()
    with open(os.path.join(SHM_DIR, eng.shm_name), "r+b") as f:
        f.seek(pos)
        byte = f.read(1)[0]
        f.seek(pos)
        f.write(bytes([byte ^ 0x01]))


def test_peer_pull_copies_verified_blocks_and_keeps_them(engines: tuple[Engine, Engine]) -> None:
    a, b = engines
    compute_on(a)
    assert b.schedule(request("b1")) == 0  # no hint, nothing in B's tier
    req = request("b2", hint(a))
    assert b.schedule(req) == 5 * BS
    meta = b.step("b2", [9, 3, 4, 5, 6, 7], 5 * BS, 1)
    assert [op.block_id for op in meta.loads] == [9, 3, 4, 5, 6]
    assert meta.saves == []  # the loaded blocks are not saved from the cache again
    assert b.worker.get_block_ids_with_load_errors() == set()
    for src, dst in zip(range(5), [9, 3, 4, 5, 6], strict=True):
        for x, y in zip(a.block(src), b.block(dst), strict=True):
            assert torch.equal(x, y)
    b.finish_step()
    assert b.worker.counts["loaded_peer"] == 5 and b.worker.counts.get("loaded_async") is None  # in the step
    # the pulled blocks are in B's own tier now: with no hint, B loads them from there
    assert b.schedule(request("b3")) == 5 * BS
    meta = b.step("b3", [10, 11, 12, 13, 14, 15], 5 * BS, 1)
    assert {op.source for op in meta.loads} == {""}
    assert b.worker.get_block_ids_with_load_errors() == set()
    assert torch.equal(a.block(4)[1], b.block(14)[1])


def test_claims_start_after_vllms_own_prefix_hit(engines: tuple[Engine, Engine]) -> None:
    a, b = engines
    compute_on(a)
    n, _ = b.sched.get_num_new_matched_tokens(request("b", hint(a)), 2 * BS)
    assert n == 3 * BS


def test_own_tier_first_then_peer_for_the_rest(engines: tuple[Engine, Engine]) -> None:
    a, b = engines
    compute_on(a)
    short = PROMPT[: 2 * BS + 1]
    assert b.schedule(request("b1", tokens=short)) == 0
    b.step("b1", [0, 1, 2], 0, len(short))
    b.finish_step()  # B holds blocks 0, 1 itself
    assert b.schedule(request("b2", hint(a))) == 5 * BS
    meta = b.step("b2", [5, 6, 7, 8, 9, 10], 5 * BS, 1)
    assert [op.source for op in meta.loads] == ["", "", a.shm_name, a.shm_name, a.shm_name]


def test_expired_lease_foreign_layout_and_unoffered_digests_are_not_claimed(engines: tuple[Engine, Engine]) -> None:
    a, b = engines
    compute_on(a)
    assert b.schedule(request("expired", hint(a, lease_s=-1))) == 0
    assert b.schedule(request("short-lease", hint(a, lease_s=0.01))) == 0
    assert b.schedule(request("gone", {PULL_KEY: {"shm_name": "kvmesh-ut-nope", "lease_until_ns": 2**62}})) == 0
    assert b.schedule(request("some", hint(a, digests=digests_of(a)[:2]))) == 2 * BS
    other = Engine(model="another-model")
    try:
        assert other.schedule(request("layout", hint(a))) == 0
    finally:
        other.close()


def test_corrupt_byte_fails_the_block_and_the_rest(engines: tuple[Engine, Engine]) -> None:
    a, b = engines
    compute_on(a)
    flip_byte(a, digests_of(a)[2])
    assert b.schedule(request("b", hint(a))) == 5 * BS
    b.step("b", [1, 2, 3, 4, 5, 6], 5 * BS, 1)
    assert b.worker.get_block_ids_with_load_errors() == {3, 4, 5}
    assert b.worker.get_block_ids_with_load_errors() == set()  # reported once
    assert torch.equal(a.block(1)[0], b.block(2)[0])  # blocks before the failure did load
    # B did not keep the corrupt block in its own tier
    own = RegionReader.attach(b.shm_name)
    assert own.locate(digests_of(a))[2] is None and own.locate(digests_of(a))[1] is not None
    own.close()


def test_slot_reused_between_claim_and_load_is_stale(engines: tuple[Engine, Engine]) -> None:
    a, b = engines
    compute_on(a)
    assert b.schedule(request("b", hint(a))) == 5 * BS
    region = a.worker._region
    assert region is not None
    d = digests_of(a)[0]
    assert region.evict(d)
    assert region.put(d, bytes(region.block_bytes), time.monotonic_ns())  # same identity, a new generation
    b.step("b", [1, 2, 3, 4, 5, 6], 5 * BS, 1)
    assert b.worker.get_block_ids_with_load_errors() == {1, 2, 3, 4, 5}


def test_region_gone_before_the_load_fails_the_blocks(engines: tuple[Engine, Engine]) -> None:
    a, b = engines
    compute_on(a)
    assert b.schedule(request("b", hint(a))) == 5 * BS
    a.worker.shutdown()  # the peer's region is unlinked before B's worker side ever attached it
    b.step("b", [1, 2, 3, 4, 5, 6], 5 * BS, 1)
    assert b.worker.get_block_ids_with_load_errors() == {1, 2, 3, 4, 5}


def test_chunked_prefill_and_resume_follow_the_block_lists(engines: tuple[Engine, Engine]) -> None:
    a, _ = engines
    req = request("r")
    assert a.schedule(req) == 0
    meta = a.step("r", [0, 1], 0, 8)  # chunk 1: blocks 0, 1
    assert [s.block_id for s in meta.saves] == [0, 1]
    a.finish_step()

    def cached_step(block_ids: list[int] | None, num_computed: int, n: int, resumed: bool) -> KvmeshMetadata:
        out = SimpleNamespace(
            scheduled_new_reqs=[],
            num_scheduled_tokens={"r": n},
            scheduled_cached_reqs=SimpleNamespace(
                req_ids=["r"],
                resumed_req_ids={"r"} if resumed else set(),
                new_block_ids=[(block_ids,) if block_ids is not None else None],
                num_computed_tokens=[num_computed],
            ),
        )
        m = a.sched.build_connector_meta(out)
        assert isinstance(m, KvmeshMetadata)
        return m

    assert [s.block_id for s in cached_step([2, 3], 8, 8, False).saves] == [2, 3]  # chunk 2 appends blocks
    # preempted and resumed from scratch: a resumed request's list replaces the old one
    assert [s.block_id for s in cached_step([7, 8, 9, 10, 11, 12], 0, 21, True).saves] == [7, 8, 9, 10, 11]
    a.sched.request_finished(req, [])  # type: ignore[arg-type]
    assert cached_step([1], 21, 1, False).saves == []  # a finished request is forgotten


def test_stats_report_block_counts_once(engines: tuple[Engine, Engine]) -> None:
    a, b = engines
    compute_on(a)
    stats = a.worker.get_kv_connector_stats()
    assert stats is not None and stats.reduce() == {"saved": 5}
    assert a.worker.get_kv_connector_stats() is None
    b.schedule(request("b", hint(a)))
    b.step("b", [1, 2, 3, 4, 5, 6], 5 * BS, 1)
    got = b.worker.get_kv_connector_stats()
    assert got is not None
    total = KvmeshConnector.build_kv_connector_stats({"loaded_peer": 1, "saved": 2})
    assert total is not None and total.aggregate(got).reduce() == {"loaded_peer": 6, "saved": 2}


# -- asynchronous loads, background saves -------------------------------------------------------------
def finished(
    eng: Engine, finished_req_ids: set[str] | None = None, timeout_s: float = 10.0
) -> tuple[set[str], set[str]]:
    """The worker side's step end as vLLM's model runner calls it (`get_finished`, then the load errors), until
    it reports something or `timeout_s` passes: (finished_sending, finished_recving); the failed block ids of
    that step land in `eng.failed`, and the scheduler side is given the step's output."""
    from vllm.v1.outputs import KVConnectorOutput

    deadline = time.monotonic() + timeout_s
    ids = set(finished_req_ids or ())
    while True:
        sending, recving = eng.worker.get_finished(ids)
        failed = eng.worker.get_block_ids_with_load_errors()
        eng.failed |= failed
        eng.sched.update_connector_output(
            KVConnectorOutput(finished_sending=sending, finished_recving=recving, invalid_block_ids=failed)
        )
        if sending or recving or time.monotonic() > deadline:
            return set(sending or ()), set(recving or ())
        ids = set()  # vLLM passes a finished request once
        eng.worker._io.run(_Job())  # type: ignore[union-attr]  # the next step: after the thread's queued work


@pytest.fixture
def async_engines() -> Iterator[tuple[Engine, Engine]]:
    a, b = Engine(), Engine(load_async=True)
    try:
        yield a, b
    finally:
        a.close()
        b.close()


def load_async(b: Engine, rid: str, block_ids: list[int]) -> KvmeshMetadata:
    """B's step after vLLM parked `rid`: the metadata carries its loads, the worker starts them (after the
    forward, as vLLM calls it for a step without synchronous loads) and the step does not wait for them."""
    meta = b.step("other", [], 0, 0)  # another request's step: `rid` is not scheduled while it loads
    assert meta.loads == [] and {op.req_id for op in meta.async_loads} == {rid}
    assert [op.block_id for op in meta.async_loads] == block_ids[: len(meta.async_loads)]
    b.finish_step()
    return meta


def test_async_load_runs_off_the_step_and_is_reported_finished(async_engines: tuple[Engine, Engine]) -> None:
    a, b = async_engines
    compute_on(a)
    req = request("b1", hint(a))
    assert b.schedule(req, [9, 3, 4, 5, 6, 7]) == 5 * BS  # (n, True): vLLM parks it in WAITING_FOR_REMOTE_KVS
    assert b.sched.get_num_new_matched_tokens(req, 0) == (0, False)  # no second claim while it loads
    load_async(b, "b1", [9, 3, 4, 5, 6, 7])
    assert finished(b) == (set(), {"b1"})
    assert b.failed == set()
    for src, dst in zip(range(5), [9, 3, 4, 5, 6], strict=True):
        for x, y in zip(a.block(src), b.block(dst), strict=True):
            assert torch.equal(x, y)
    assert b.worker.counts["loaded_peer"] == b.worker.counts["loaded_async"] == 5
    # vLLM schedules it now, with the loaded tokens computed: nothing loaded again, nothing saved again
    b.sched.update_state_after_alloc(req, SimpleNamespace(get_block_ids=lambda: ([],)), 0)  # type: ignore[arg-type]
    meta = b.step("b1", [9, 3, 4, 5, 6, 7], 5 * BS, 1)
    assert meta.loads == meta.async_loads == meta.saves == []


def test_async_load_failure_is_reported_with_the_request_and_never_claimed_again(
    async_engines: tuple[Engine, Engine],
) -> None:
    a, b = async_engines
    compute_on(a)
    flip_byte(a, digests_of(a)[2])
    req = request("b1", hint(a))
    assert b.schedule(req, [1, 2, 3, 4, 5, 6]) == 5 * BS
    load_async(b, "b1", [1, 2, 3, 4, 5, 6])
    assert finished(b) == (set(), {"b1"})
    assert b.failed == {3, 4, 5}  # the corrupt block and all after it, by the step that reports the request
    assert torch.equal(a.block(1)[0], b.block(2)[0])  # the blocks before it did load
    # vLLM looks the request up again (its computed tokens were cut back): it is computed, not claimed
    assert b.sched.get_num_new_matched_tokens(req, 2 * BS) == (0, False)


def test_a_lease_that_ends_before_the_copy_fails_the_load_closed(async_engines: tuple[Engine, Engine]) -> None:
    a, b = async_engines
    compute_on(a)
    req = request("b1", hint(a, lease_s=0.3))
    assert b.schedule(req, [1, 2, 3, 4, 5, 6]) == 5 * BS
    deadline = time.monotonic() + 10
    while time.monotonic_ns() < req.kv_transfer_params[PULL_KEY]["lease_until_ns"]:  # the lease runs out
        assert time.monotonic() < deadline
        a.drain()  # (the thread's queue: a bounded, condition-based wait)
    load_async(b, "b1", [1, 2, 3, 4, 5, 6])
    assert finished(b) == (set(), {"b1"})
    assert b.failed == {1, 2, 3, 4, 5}


def test_a_request_aborted_while_it_loads_is_still_reported(async_engines: tuple[Engine, Engine]) -> None:
    """vLLM holds an aborted waiting request's blocks until the load is reported: it must be, loaded or not."""
    a, b = async_engines
    compute_on(a)
    req = request("b1", hint(a))
    assert b.schedule(req, [1, 2, 3, 4, 5, 6]) == 5 * BS
    assert b.sched.request_finished(req, []) == (False, None)  # vLLM itself delays the frees of a waiting load
    load_async(b, "b1", [1, 2, 3, 4, 5, 6])
    sending, recving = finished(b, {"b1"})
    assert sending == set() and recving == {"b1"}


def test_sync_and_async_loads_copy_the_same_bytes() -> None:
    a, s, n = Engine(), Engine(), Engine(load_async=True)
    try:
        compute_on(a)
        assert s.schedule(request("s", hint(a))) == 5 * BS
        s.step("s", [1, 2, 3, 4, 5, 6], 5 * BS, 1)
        assert n.schedule(request("n", hint(a)), [1, 2, 3, 4, 5, 6]) == 5 * BS
        load_async(n, "n", [1, 2, 3, 4, 5, 6])
        assert finished(n) == (set(), {"n"})
        for i in range(1, 6):
            for x, y in zip(s.block(i), n.block(i), strict=True):
                assert torch.equal(x, y)
    finally:
        for e in (a, s, n):
            e.close()


def hold_io(eng: Engine) -> threading.Event:
    """Holds eng's tier I/O thread (on a job that waits for the returned gate, at most 10 s), so the work
    queued after it stays queued until the test sets the gate."""
    io = eng.worker._io
    assert io is not None
    gate, run = threading.Event(), io._run_job
    io._run_job = lambda job: gate.wait(10) if job is held else run(job)  # type: ignore[method-assign,assignment]
    held = io.submit(_Job())
    return gate


def test_saves_hold_the_requests_blocks_until_published() -> None:
    """A finished request whose blocks are still being saved keeps them (request_finished -> True) until
    get_finished reports it sent, only after its blocks are in the tier; a request that saved nothing is
    freed at once."""
    a = Engine()
    try:
        req = request("a1")
        assert a.schedule(req) == 0
        a.step("a1", list(range(6)), 0, len(PROMPT))
        gate = hold_io(a)
        a.worker.wait_for_save()  # returns with the saves queued: the step is not held
        a.worker.clear_connector_metadata()
        assert a.sched.request_finished(req, []) == (True, None)
        assert a.worker.get_finished({"a1"}) == (None, None)  # not yet: its blocks are still to be read
        assert a.worker.counts["saved"] == 0
        reader = RegionReader.attach(a.shm_name)
        assert reader.locate(digests_of(a)) == [None] * 5  # not offered before it is published
        gate.set()
        assert finished(a) == ({"a1"}, set())
        assert a.worker.counts["saved"] == 5
        assert all(r is not None for r in reader.locate(digests_of(a)))
        reader.close()
        other = request("a2", tokens=PROMPT[:3])  # no full block: nothing to save, freed at once
        a.schedule(other)
        a.step("a2", [7], 0, 3)
        a.finish_step()
        assert a.sched.request_finished(other, []) == (False, None)
    finally:
        a.close()


def test_a_preempted_requests_pending_saves_finish_before_the_step() -> None:
    a = Engine()
    try:
        assert a.schedule(request("a1")) == 0
        a.step("a1", list(range(6)), 0, len(PROMPT))
        gate = hold_io(a)
        a.worker.wait_for_save()
        a.worker.clear_connector_metadata()
        waiter = threading.Thread(target=a.worker.handle_preemptions, args=(KvmeshMetadata(preempted=["a1"]),))
        waiter.start()
        waiter.join(0.2)
        assert waiter.is_alive()  # held: a1's blocks are about to be reused, its saves have not read them
        a.worker.handle_preemptions(KvmeshMetadata(preempted=["other"]))  # nothing pending: no wait
        gate.set()
        waiter.join(10)
        assert not waiter.is_alive() and a.worker.counts["saved"] == 5
    finally:
        a.close()


def test_synchronous_saves_are_done_when_the_step_ends() -> None:
    a = Engine(save_async=False)
    try:
        assert a.schedule(request("a1")) == 0
        a.step("a1", list(range(6)), 0, len(PROMPT))
        a.worker.wait_for_save()  # no drain: the step itself waited
        assert a.worker.counts["saved"] == 5
        a.worker.clear_connector_metadata()
    finally:
        a.close()


def test_a_worker_whose_connector_is_off_fails_and_finishes_async_loads(async_engines: tuple[Engine, Engine]) -> None:
    """KV tensors that do not match the layout turn the worker side off; a load the scheduler side planned
    anyway is reported failed (all its blocks) and finished, so vLLM computes the request, never reads
    unloaded blocks as loaded."""
    a, b = async_engines
    compute_on(a)
    off = KvmeshConnector(vllm_config(f"kvmesh-ut-{uuid.uuid4().hex[:12]}", load_async=True), KVConnectorRole.WORKER)
    off.register_kv_caches({"layer.0": torch.zeros(NUM_BLOCKS, HEADS, BS, 2 * HEAD, dtype=torch.float16)})
    try:
        assert off._io is None
        assert b.schedule(request("b1", hint(a)), [1, 2, 3, 4, 5, 6]) == 5 * BS
        out = SimpleNamespace(
            scheduled_new_reqs=[],
            num_scheduled_tokens={},
            scheduled_cached_reqs=SimpleNamespace(
                req_ids=[], resumed_req_ids=set(), new_block_ids=[], num_computed_tokens=[]
            ),
        )
        off.bind_connector_metadata(b.sched.build_connector_meta(out))  # type: ignore[arg-type]
        off.start_load_kv(None)  # type: ignore[arg-type]
        assert off.get_finished(set()) == (None, {"b1"})
        assert off.get_block_ids_with_load_errors() == {1, 2, 3, 4, 5}
    finally:
        off.shutdown()


def test_settings_refuse_bad_values_naming_the_key() -> None:
    with pytest.raises(ValueError, match="load_async"):
        ConnectorSettings.from_extra({"load_async": "yes"})
    with pytest.raises(ValueError, match="io_nice"):
        ConnectorSettings.from_extra({"io_nice": 25})
    with pytest.raises(ValueError, match="io_nice"):
        ConnectorSettings.from_extra({"io_nice": True})
    settings = ConnectorSettings.from_extra({"load_async": "false", "save_async": False})
    assert not settings.load_async and not settings.save_async and settings.io_nice == DEFAULT_IO_NICE
    assert ConnectorSettings.from_extra({}).load_async  # asynchronous by default


def test_io_nice_lowers_background_copies_only() -> None:
    """`io_nice` applies to the I/O thread of asynchronous loads; a synchronous load, which the step waits
    for, runs at the engine's priority whatever it says."""
    process_nice = os.getpriority(os.PRIO_PROCESS, 0)
    sync, background = Engine(io_nice=10), Engine(load_async=True, io_nice=10)
    try:
        for eng, nice in ((sync, process_nice), (background, max(10, process_nice))):
            eng.drain()  # the thread has set its priority before its first job
            assert eng.worker._io is not None
            tid = eng.worker._io._thread.native_id
            assert tid is not None and os.getpriority(os.PRIO_PROCESS, tid) == nice
    finally:
        sync.close()
        background.close()


# -- tier events ---------------------------------------------------------------------------------------
WORKER = "w0"


def vllm_request(rid: str, tokens: list[int], cache_salt: str | None = None, params: Any = None) -> Any:
    """A real vLLM request: its block hashes come from vLLM's own hasher (sha256 over CBOR)."""
    from vllm.sampling_params import SamplingParams
    from vllm.utils.hashing import sha256_cbor
    from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash
    from vllm.v1.request import Request

    init_none_hash(sha256_cbor)
    req = Request(
        rid,
        list(tokens),
        SamplingParams(max_tokens=1),
        None,
        cache_salt=cache_salt,
        block_hasher=get_request_block_hasher(BS, sha256_cbor),
    )
    req.kv_transfer_params = params
    return req


def ext(req: Any, n: int) -> list[Any]:
    """The first `n` block hashes of `req` as vLLM's events carry them (bytes, or ints when configured)."""
    from vllm.v1.core.kv_cache_utils import maybe_convert_block_hash

    return [maybe_convert_block_hash(h) for h in req.block_hashes[:n]]


def tier_events(eng: Engine) -> list[Any]:
    """What vLLM's scheduler does with the worker's output: hand it to the scheduler side, take its events."""
    from vllm.v1.outputs import KVConnectorOutput

    out = KVConnectorOutput(kv_cache_events=eng.worker.get_kv_connector_kv_cache_events())
    eng.sched.update_connector_output(out)
    return list(eng.sched.take_events())


def gpu_pool_events(req: Any, n: int) -> tuple[Any, list[Any]]:
    """vLLM's own BlockPool caching the first `n` blocks of `req`: (the pool, its BlockStored events)."""
    from vllm.v1.core.block_pool import BlockPool

    pool = BlockPool(NUM_BLOCKS, enable_caching=True, hash_block_size=BS, enable_kv_cache_events=True)
    blocks = pool.get_new_blocks(n)
    pool.cache_full_blocks(req, blocks, 0, n, BS, 0)
    return pool, pool.take_events()


def ingest(ing: Any, seq: int, events: list[Any]) -> None:
    """vLLM events the way a kvmesh worker relays them (translated, then a proto batch on its stream to the
    cache-manager) into the cache-manager's ingestor."""
    from kvmesh.core.kvevents import KvEventBatch
    from kvmesh.wire.proto import batch_from_proto, batch_to_proto
    from kvmesh.wire.vllm_events import events_from_vllm

    sent = KvEventBatch(WORKER, "i0", seq, float(seq), events_from_vllm(events))
    got = batch_from_proto(batch_to_proto(sent), WORKER, "i0")
    assert [getattr(e, "medium", None) for e in got.events] == [e.medium for e in events]
    res = ing.apply(got)
    assert res.resync is None and res.applied == [seq]


def ingestor() -> Any:
    from kvmesh.cachemgr.hasher import IndexHasher
    from kvmesh.cachemgr.ingest import Ingestor
    from kvmesh.index import PrefixIndex

    return Ingestor(PrefixIndex(), IndexHasher("tiny"), BS)


def test_tier_events_name_blocks_as_vllms_gpu_events_and_index_as_tier_only(engines: tuple[Engine, Engine]) -> None:
    from vllm.distributed.kv_events import BlockRemoved, BlockStored

    a, _ = engines
    req = vllm_request("a1", PROMPT, cache_salt="tenant-1")
    assert a.schedule(req) == 0
    a.step("a1", list(range(6)), 0, len(PROMPT))
    a.finish_step()
    (cpu,) = tier_events(a)
    assert tier_events(a) == []  # reported once
    _pool, (gpu,) = gpu_pool_events(req, 5)
    assert isinstance(cpu, BlockStored) and cpu.medium == "CPU" and gpu.medium == "GPU"
    for f in ("block_hashes", "parent_block_hash", "token_ids", "block_size", "lora_name", "extra_keys", "group_idx"):
        assert getattr(cpu, f) == getattr(gpu, f), f
    assert cpu.extra_keys[0] == ("tenant-1",) and cpu.block_hashes == ext(req, 5)

    ing = ingestor()
    ingest(ing, 0, [gpu])
    ingest(ing, 1, [cpu])
    st = ing.workers[WORKER]
    assert len(st.tier_copies) == 5 and st.tier_only == set()  # on the GPU and in the tier
    hashes = ing.hasher.chain(None, tuple(PROMPT[:20]), BS, None, "tenant-1")
    assert ing.gpu_run(WORKER, hashes, 5) == 5
    ingest(ing, 2, [BlockRemoved(block_hashes=gpu.block_hashes[2:], medium="GPU", group_idx=0)])
    assert st.tier_only == set(hashes[2:])  # vLLM's pool dropped them: held in the tier only
    assert ing.gpu_run(WORKER, hashes, 5) == 2
    assert set(ing.index.blocks_of(WORKER).tolist()) == set(hashes)


def test_peer_pull_kept_in_own_tier_is_announced_evictions_too(engines: tuple[Engine, Engine]) -> None:
    from vllm.distributed.kv_events import BlockRemoved, BlockStored

    a, b = engines
    req = vllm_request("a1", PROMPT)
    a.schedule(req)
    a.step("a1", list(range(6)), 0, len(PROMPT))
    a.finish_step()
    tier_events(a)
    pulled = vllm_request("b1", PROMPT, params=hint(a))
    assert b.schedule(pulled) == 5 * BS
    b.step("b1", [9, 3, 4, 5, 6, 7], 5 * BS, 1)
    b.finish_step()
    (stored,) = tier_events(b)
    assert isinstance(stored, BlockStored) and stored.medium == "CPU"
    assert stored.block_hashes == ext(pulled, 5) and stored.parent_block_hash is None

    # a long request overfills A's tier (64 slots): the LFU+LRU victims (a1's blocks first) are announced
    region = a.worker._region
    assert region is not None
    long = [5 + (11 * i) % 900 for i in range(80 * BS + 1)]
    big = vllm_request("a2", long)
    assert a.schedule(big) == 0
    a.step("a2", [i % NUM_BLOCKS for i in range(81)], 0, len(long))
    a.finish_step()
    events = tier_events(a)
    removed = [h for e in events if isinstance(e, BlockRemoved) for h in e.block_hashes]
    stored_h = [h for e in events if isinstance(e, BlockStored) for h in e.block_hashes]
    assert all(e.medium == "CPU" for e in events)
    assert set(ext(req, 5)) <= set(removed)
    assert len(stored_h) == 80 and len(removed) == 5 + 80 - region.num_slots
    in_tier = {h for h in [*ext(req, 5), *stored_h] if h not in removed}
    assert len(in_tier) == len(region) == len(a.worker._log)  # the hash map holds the tier's blocks only
    # chained runs: every stored event's parent is the block before its first one
    for e in events:
        if isinstance(e, BlockStored):
            i = ext(big, 80).index(e.block_hashes[0])
            assert e.parent_block_hash == (ext(big, 80)[i - 1] if i else None)
            assert e.token_ids == long[i * BS : (i + len(e.block_hashes)) * BS]
    ing = ingestor()
    ingest(ing, 0, events)  # CPU events only: every block held is tier-only
    st = ing.workers[WORKER]
    assert len(st.tier_only) == len(ing.index.blocks_of(WORKER)) == 80 - len(removed) + 5


def test_worker_mirror_keeps_a_blocks_gpu_and_tier_copies_apart(engines: tuple[Engine, Engine]) -> None:
    """The worker's CacheMirror (its dumps, its cached-blocks gauge) follows both copies of a block under one
    hash: vLLM's pool dropping its copy leaves the tier's, and the other way round."""
    from vllm.distributed.kv_events import BlockRemoved

    from kvmesh.engine.mirror import CacheMirror
    from kvmesh.wire.vllm_events import engine_hash, events_from_vllm

    a, _ = engines
    req = vllm_request("a1", PROMPT, cache_salt="t")
    a.schedule(req)
    a.step("a1", list(range(6)), 0, len(PROMPT))
    a.finish_step()
    _pool, gpu = gpu_pool_events(req, 5)
    hashes = [engine_hash(h) for h in ext(req, 5)]
    m = CacheMirror()
    for e in events_from_vllm([*gpu, *tier_events(a)]):
        m.apply(m.with_chain_tenant(e))
    assert len(m) == 5 and len(m.dump()) == 10  # 5 blocks, each on the GPU and in the tier
    gpu_gone = BlockRemoved(block_hashes=gpu[0].block_hashes[3:], medium="GPU", group_idx=0)
    for e in events_from_vllm([gpu_gone]):
        m.apply(e)
    assert len(m) == 3 and m.hashes() == set(hashes)
    assert {(e.block_hashes[0], e.medium) for e in m.dump()} >= {(h, "CPU") for h in hashes}
    assert all(e.tenant == "t" for e in m.dump())
    # a resync from this dump rebuilds the cache-manager's view: blocks 3, 4 tier-only, 0-2 on both media
    ing = ingestor()
    ing.begin_dump(WORKER, "i0")
    assert ing.apply_dump(WORKER, m.dump()).resync is None
    ing.end_dump(WORKER, 0)
    index_hashes = ing.hasher.chain(None, tuple(PROMPT[:20]), BS, None, "t")
    assert ing.workers[WORKER].tier_only == set(index_hashes[3:])
    assert ing.gpu_run(WORKER, index_hashes, 5) == 3
    a.worker._region.evict(a.sched._trackers["a1"].digests[0])  # type: ignore[union-attr]
    a.worker._log.evicted(a.worker._region.drain_evicted())  # type: ignore[union-attr]
    for e in events_from_vllm(tier_events(a)):
        m.apply(e)
    assert [e.medium for e in m.dump() if e.block_hashes[0] == hashes[0]] == ["GPU"]
