"""The vLLM connector's pure parts: block identity and layout, leased pulls, load plans, save tracking."""

from __future__ import annotations

from dataclasses import dataclass

import pytest

from kvmesh.core.pull import KvPull
from kvmesh.kvplane.vllm_connector.layout import KvLayout, block_digests, block_salt, dtype_itemsize
from kvmesh.kvplane.vllm_connector.plan import (
    LEASE_MARGIN_NS,
    OWN,
    PULL_KEY,
    BlockSource,
    RequestTracker,
    SaveOp,
    lease_covers,
    lease_usable,
    loadable_blocks,
    offered,
    parse_pull,
    plan_loads,
    pull_params,
)

LAYOUT = KvLayout("m", "torch.bfloat16", 32, 2, 2, 32)


@dataclass(frozen=True)
class Ref:
    slot: int
    generation: int


def test_block_bytes_and_describe() -> None:
    assert LAYOUT.block_bytes == 2 * 2 * 32 * 2 * 32 * 2
    assert dtype_itemsize("torch.float32") == 4
    with pytest.raises(ValueError):
        dtype_itemsize("torch.int64")
    assert len(LAYOUT.describe().encode()) <= 256
    assert KvLayout("m", "torch.float16", 32, 2, 2, 32).describe() != LAYOUT.describe()


def test_identity_covers_tokens_model_lora_tenant_dtype_block_size_layout() -> None:
    toks = list(range(3, 3 + 96))
    base = block_digests(toks, LAYOUT)
    assert len(base) == 3 and len(set(base)) == 3
    assert block_digests(toks, LAYOUT) == base
    assert block_digests(toks[:64] + [1] * 32, LAYOUT)[:2] == base[:2]  # chained: a prefix keeps its ids
    assert block_digests(toks[:64] + [1] * 32, LAYOUT)[2] != base[2]
    others = [
        block_digests(toks, KvLayout("m2", "torch.bfloat16", 32, 2, 2, 32)),
        block_digests(toks, LAYOUT, lora="adapter"),
        block_digests(toks, LAYOUT, cache_salt="tenant-b"),
        block_digests(toks, KvLayout("m", "torch.float16", 32, 2, 2, 32)),
        block_digests(toks, KvLayout("m", "torch.bfloat16", 32, 4, 2, 32)),
        block_digests(toks, KvLayout("m", "torch.bfloat16", 32, 2, 2, 32, kind="NHD")),
    ]
    for other in others:
        assert not set(other) & set(base)
    assert len(block_digests(toks, KvLayout("m", "torch.bfloat16", 64, 2, 2, 32))) == 1
    # length-delimited: moving a character between LoRA and tenant changes the salt
    assert block_salt(LAYOUT, "ab", "c") != block_salt(LAYOUT, "a", "bc")


def test_parse_pull() -> None:
    d = bytes(range(32))
    assert parse_pull(None) is None
    assert parse_pull({}) is None
    assert parse_pull({PULL_KEY: "x"}) is None
    assert parse_pull({PULL_KEY: {"shm_name": "", "lease_until_ns": 5}}) is None
    assert parse_pull({PULL_KEY: {"shm_name": "r", "lease_until_ns": "5"}}) is None
    assert parse_pull({PULL_KEY: {"shm_name": "r", "lease_until_ns": True}}) is None
    assert parse_pull({PULL_KEY: {"shm_name": "r", "lease_until_ns": 5, "digests": ["zz"]}}) is None
    assert parse_pull({PULL_KEY: {"shm_name": "r", "lease_until_ns": 5, "digests": "ab"}}) is None
    assert parse_pull({PULL_KEY: {"shm_name": "r", "lease_until_ns": 5}}) == KvPull(shm_name="r", lease_until_ns=5)
    pull = parse_pull({PULL_KEY: {"shm_name": "r", "lease_until_ns": 5, "digests": [d.hex()]}})
    assert pull == KvPull(shm_name="r", num_blocks=1, digests=(d,), lease_until_ns=5)


def test_a_leased_pull_round_trips_through_the_params() -> None:
    pull = KvPull(shm_name="r", num_blocks=2, digests=(bytes(32), bytes(range(32))), lease_until_ns=7)
    assert parse_pull(pull_params(pull)) == pull
    assert pull_params(KvPull(shm_name="r", lease_until_ns=7)) is None  # no digests: nothing to load
    assert pull_params(None) is None


def test_only_offered_blocks_are_loaded_from_the_peer() -> None:
    d, other = bytes(range(32)), b"\0" * 32
    refs = [Ref(1, 2), Ref(2, 2)]
    assert offered(KvPull(shm_name="r", digests=(d,)), [d, other], refs) == [Ref(1, 2), None]
    assert offered(KvPull(shm_name="r"), [d, other], refs) == refs  # no digests: any block


def test_lease_must_outlast_the_copy() -> None:
    pull = KvPull(shm_name="r", lease_until_ns=1_000_000_000)
    assert lease_usable(pull, 0)
    assert not lease_usable(pull, 1_000_000_000 - LEASE_MARGIN_NS)
    assert not lease_usable(pull, 2_000_000_000)


def test_loadable_blocks_leaves_the_last_token_to_compute() -> None:
    assert loadable_blocks(64, 32) == 1
    assert loadable_blocks(65, 32) == 2
    assert loadable_blocks(4000, 32) == 124
    assert loadable_blocks(0, 32) == 0


def test_plan_prefers_own_tier_then_peer_and_stops_at_a_gap() -> None:
    own = [Ref(1, 2), None, None, Ref(9, 2)]
    peer = [Ref(5, 4), Ref(6, 4), None, Ref(7, 4)]
    plan = plan_loads(3, own, peer, "peer")
    assert plan == [BlockSource(3, OWN, 1, 2), BlockSource(4, "peer", 6, 4)]
    assert plan_loads(0, [None, None], [], "") == []
    assert plan_loads(0, [Ref(0, 2), Ref(1, 2)], [], "") == [BlockSource(0, OWN, 0, 2), BlockSource(1, OWN, 1, 2)]


def test_a_peer_block_carries_the_pulls_lease_and_an_own_block_none() -> None:
    plan = plan_loads(0, [Ref(1, 2), None], [None, Ref(6, 4)], "peer", 5_000)
    assert [(s.source, s.lease_until_ns) for s in plan] == [(OWN, 0), ("peer", 5_000)]
    tr = tracker(list(range(3, 20)))
    tr.digests_upto(4)
    tr.planned, tr.block_ids = plan, [10, 11]
    assert [op.lease_until_ns for op in tr.loads("r")] == [0, 5_000]


def test_a_copy_starts_only_within_its_lease() -> None:
    assert lease_covers(0, 10**18)  # the own tier: no lease
    assert lease_covers(1_000, 999)
    assert not lease_covers(1_000, 1_000)  # ended: the block and the rest fail closed
    assert not lease_covers(1_000, 2_000)


L4 = KvLayout("m", "torch.bfloat16", 4, 2, 2, 32)


def tracker(tokens: list[int]) -> RequestTracker:
    return RequestTracker(tokens, block_salt(L4, None, None), 4)


def test_tracker_digests_follow_the_tokens_as_they_grow() -> None:
    toks = list(range(3, 13))  # 2 full blocks of 4 + 2 tokens
    tr = tracker(toks)
    assert tr.digests_upto(5) == block_digests(toks, L4)
    assert len(tr.digests_upto(5)) == 2
    toks += [1, 2]  # decoding: the third block fills up
    assert len(tr.digests_upto(5)) == 3
    assert tr.digests_upto(2) == tr.digests[:2]


def test_tracker_loads_map_to_allocated_blocks_once() -> None:
    tr = tracker(list(range(3, 20)))
    digests = tr.digests_upto(4)
    tr.planned = [BlockSource(1, OWN, 7, 2), BlockSource(2, "p", 8, 4)]
    tr.block_ids = [10, 11, 12, 13]
    ops = tr.loads("r")
    assert [(o.block_id, o.digest, o.source, o.slot, o.generation) for o in ops] == [
        (11, digests[1], OWN, 7, 2),
        (12, digests[2], "p", 8, 4),
    ]
    assert tr.loads("r") == []


def test_tracker_saves_newly_computed_blocks_prompt_and_generated() -> None:
    toks = list(range(3, 24))  # a 5-block prompt of block size 4 (+ 1 token)
    tr = tracker(toks)
    d = tr.digests_upto(5)
    tr.block_ids = [20, 21, 22]
    # first step: 1 block hit in vLLM's cache + 1 loaded; 13 tokens scheduled: blocks 2 and 3 complete,
    # but only 3 vLLM blocks are listed so far, so only block 2 is saved now
    assert tr.step(8, 13) == [SaveOp(22, d[2], 2)]
    tr.block_ids += [23, 24, 25]
    assert tr.step(21, 0) == [SaveOp(23, d[3], 3), SaveOp(24, d[4], 4)]
    # decoding: token 21's KV is computed, but block 5 (tokens 20..23) is not full of known tokens yet
    assert tr.step(21, 1) == []
    toks += [7, 8, 9]  # tokens 21..23 are known now (the last one only sampled)
    assert tr.step(22, 1) == []  # block 5 needs the KV of token 23
    assert tr.step(23, 1) == [SaveOp(25, tr.digests_upto(6)[5], 5)]
    # a load failure sends vLLM back to block 1: the recomputed blocks are saved again
    assert tr.step(4, 8) == [SaveOp(21, d[1], 1), SaveOp(22, d[2], 2)]


def test_tracker_knows_whether_its_blocks_must_outlive_the_request() -> None:
    """A request that issued saves is finished with its blocks held (the worker may still be copying them);
    the saves name it, so the worker side can report it when they are done."""
    tr = RequestTracker(list(range(3, 12)), block_salt(L4, None, None), 4, req_id="r")
    tr.block_ids = [5, 6, 7]
    assert tr.step(0, 3) == [] and not tr.saves_issued  # no full block yet
    assert tr.step(3, 6) == [SaveOp(5, tr.digests[0], 0, req_id="r"), SaveOp(6, tr.digests[1], 1, req_id="r")]
    assert tr.saves_issued


def test_tracker_records_a_failed_asynchronous_load() -> None:
    tr = tracker(list(range(3, 20)))
    tr.loading = {4, 5}
    tr.load_done({9})  # another request's block failed
    assert not tr.load_failed and tr.loading == set()
    tr.loading = {4, 5}
    tr.load_done({5})
    assert tr.load_failed and tr.loading == set()
