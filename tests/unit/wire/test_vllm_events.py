"""`kvmesh.wire.vllm_events`: vLLM's KV-event frame codec, hash conversion, kv-group filter and tenant."""

from __future__ import annotations

import msgspec
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvmesh.core.kvevents import AllBlocksCleared, BlockRemoved, BlockStored, KvEventBatch
from kvmesh.wire.vllm_events import (
    MASK64,
    VllmBlockRemoved,
    VllmBlockStored,
    VllmEventBatch,
    VllmTranslator,
    decode_seq,
    encode_payload,
    encode_seq,
    engine_hash,
    events_from_vllm,
    make_decoder,
)
from tests.support.kv_strategies import kv_batch, u64

pytestmark = pytest.mark.unit


def stored(*hs: int, parent: int | None = None) -> BlockStored:
    return BlockStored(tuple(hs), parent, tuple(range(2 * len(hs))), 2)


@settings(max_examples=60, deadline=None)
@given(kv_batch(tenant_on_children=False, worker_id="w"), st.booleans())
def test_decode_of_encode_is_identity(b: KvEventBatch, prefer_vllm: bool) -> None:
    tr = VllmTranslator("w", prefer_vllm=prefer_vllm)
    back = tr.decode(encode_seq(b.sequence), encode_payload(b))
    assert (back.sequence, back.timestamp, back.events, back.dp_rank) == (b.sequence, b.timestamp, b.events, b.dp_rank)
    assert (back.worker_id, back.instance_id) == ("w", "vllm-g0")


@given(u64, st.integers(0, 24))
def test_bytes_hashes_become_their_low_64_bits(x: int, extra_bytes: int) -> None:
    wide = x | (1 << (64 + 8 * extra_bytes)) if extra_bytes else x
    assert engine_hash(wide.to_bytes(8 + extra_bytes + 1, "big")) == x
    assert engine_hash(wide) == x & MASK64


@given(st.integers(-(1 << 63), (1 << 63) - 1))
def test_sequence_numbers_round_trip(seq: int) -> None:
    assert decode_seq(encode_seq(seq)) == seq and len(encode_seq(seq)) == 8


def test_encoding_matches_vllm_layout() -> None:
    batch = KvEventBatch("w", "i", 7, 1.5, (stored(1, 2), BlockRemoved((2,), "GPU"), AllBlocksCleared()))
    ts, events, rank = msgspec.msgpack.decode(encode_payload(batch))
    assert ts == 1.5 and rank == 0
    assert events[0] == {
        "type": "BlockStored",
        "block_hashes": [1, 2],
        "parent_block_hash": None,
        "token_ids": [0, 1, 2, 3],
        "block_size": 2,
        "lora_id": None,
        "medium": None,
        "lora_name": None,
    }
    assert events[1] == {"type": "BlockRemoved", "block_hashes": [2], "medium": "GPU"}
    assert events[2] == {"type": "AllBlocksCleared"}


@pytest.mark.parametrize("prefer_vllm", [True, False])
def test_only_the_configured_kv_group_is_kept(prefer_vllm: bool) -> None:
    payload = msgspec.msgpack.encode(
        VllmEventBatch(
            1.0,
            [
                VllmBlockStored([b"\x01" * 32], None, [1, 2], 2, None, "GPU", None, None, 0),
                VllmBlockStored([5], None, [3, 4], 2, None, "GPU", None, None, 1),
                VllmBlockRemoved([6], "GPU", 1),
                VllmBlockRemoved([7], "GPU"),  # no group: kept (older vLLM)
            ],
        )
    )
    dec, _ = make_decoder(prefer_vllm)
    g0 = events_from_vllm(dec.decode(payload).events, kv_group=0)
    assert g0 == (
        BlockStored((0x0101010101010101,), None, (1, 2), 2, None, "GPU"),
        BlockRemoved((7,), "GPU"),
    )
    g1 = events_from_vllm(dec.decode(payload).events, kv_group=1)
    assert g1 == (BlockStored((5,), None, (3, 4), 2, None, "GPU"), BlockRemoved((6,), "GPU"), BlockRemoved((7,), "GPU"))


def test_translator_moves_the_instance_on_a_live_restart_only() -> None:
    tr = VllmTranslator("w", boot_id="b", prefer_vllm=False)
    payload = encode_payload(KvEventBatch("w", "i", 0, 0.0, ()))
    assert tr.decode(encode_seq(5), payload).instance_id == "b-g0"
    assert tr.decode(encode_seq(2), payload, live=False).instance_id == "b-g0"  # a replay of older batches
    assert tr.decode(encode_seq(1), payload).instance_id == "b-g1"  # the counter restarted: vLLM restarted
