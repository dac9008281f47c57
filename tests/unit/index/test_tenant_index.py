"""Tenant isolation through the KV index: events carry the tenant (cache salt) from the engines through
every wire format (proto, vLLM ZMQ, checkpoint log) into the index, which salts root blocks with
`make_salt(model, lora, tenant)`; children inherit their chain's tenant."""

from __future__ import annotations

import pytest

from kvmesh.cachemgr.core import CacheCore
from kvmesh.core.kvevents import BlockRemoved, BlockStored, KvEventBatch, cache_salt_of
from kvmesh.engine.mirror import CacheMirror
from kvmesh.engine.sim.pool import BlockPool
from kvmesh.wire import ingest_log as codec
from kvmesh.wire.proto import event_from_proto, event_to_proto
from kvmesh.wire.vllm_events import encode_payload, events_from_vllm, extra_keys_of, make_decoder

pytestmark = pytest.mark.unit
BS = 4
MODEL = "m"
TOKS = tuple(range(100, 100 + 4 * BS))


def batch(worker: str, seq: int, *events: object) -> KvEventBatch:
    return KvEventBatch(worker, "i0", seq, 0.0, tuple(events))  # type: ignore[arg-type]


def matches(core: CacheCore, tokens: tuple[int, ...], tenant: str | None) -> dict[str, int]:
    return core.index.find_matches(core.hashes_of(tokens, tenant=tenant))


def test_index_separates_tenants_and_children_inherit_the_chain_tenant() -> None:
    core = CacheCore(BS, MODEL)
    # same tokens: worker a under tenant A (first 2 blocks, then a continuation without tenant), b under B
    core.apply(
        batch(
            "a",
            0,
            BlockStored((1, 2), None, TOKS[: 2 * BS], BS, tenant="A"),
            BlockStored((3, 4), 2, TOKS[2 * BS :], BS),
        )
    )
    core.apply(batch("b", 0, BlockStored((1, 2), None, TOKS[: 2 * BS], BS, tenant="B")))
    core.apply(batch("c", 0, BlockStored((9,), None, TOKS[:BS], BS)))
    assert matches(core, TOKS, "A") == {"a": 4}  # the continuation is A's: it chains on A's root
    assert matches(core, TOKS, "B") == {"b": 2}
    assert matches(core, TOKS, None) == {"c": 1}
    assert matches(core, TOKS, "C") == {}
    core.apply(batch("a", 1, BlockRemoved((4,))))
    assert matches(core, TOKS, "A") == {"a": 3}


def test_a_dump_restores_tenanted_chains() -> None:
    core = CacheCore(BS, MODEL)
    pool = BlockPool(8, BS)
    ids = pool.allocate(3)
    pool.cache_full_blocks(ids, [11, 12, 13], TOKS[: 3 * BS], 0, None, tenant="A")
    dump = pool.dump()
    assert [e.tenant for e in dump] == ["A", "A", "A"] and pool.drain_events()[-1].tenant == "A"  # type: ignore[union-attr]
    core.begin_dump("w", "i0")
    core.apply_dump("w", dump)
    core.end_dump("w", 0)
    assert matches(core, TOKS, "A") == {"w": 3}
    assert matches(core, TOKS, None) == {}


def test_codec_round_trips_the_tenant_and_reads_old_records() -> None:
    ev = BlockStored((1, 2), 7, TOKS[: 2 * BS], BS, "lora", "GPU", "tenant-x")
    rec = codec.LogRecord(codec.BATCH, "w", batch=batch("w", 3, ev))
    back = codec.decode_record(codec.encode_record(rec))
    assert back.batch is not None and back.batch.events == (ev,)
    old = codec.event_to_wire(ev)[:7]  # a record written before the tenant field existed
    assert codec.event_from_wire(old) == BlockStored((1, 2), 7, TOKS[: 2 * BS], BS, "lora", "GPU", None)


def test_proto_round_trips_the_tenant() -> None:
    ev = BlockStored((1,), None, TOKS[:BS], BS, None, None, "A")
    assert event_from_proto(event_to_proto(ev)) == ev
    plain = BlockStored((1,), None, TOKS[:BS], BS)
    assert event_from_proto(event_to_proto(plain)) == plain


def test_cache_salt_is_found_in_vllm_extra_keys() -> None:
    assert cache_salt_of(("A",), None) == "A"
    assert cache_salt_of(("lo", "A"), "lo") == "A"
    assert cache_salt_of(("lo",), "lo") is None
    assert cache_salt_of((("mm-id", 0), "A", b"digest"), None) == "A"
    assert cache_salt_of(None, None) is None


def test_zmq_wire_carries_the_salt_like_vllm_and_decodes_back() -> None:
    root = BlockStored((1, 2), None, TOKS[: 2 * BS], BS, "lo", None, "A")
    child = BlockStored((3,), 2, TOKS[2 * BS : 3 * BS], BS, None, None, "A")
    assert extra_keys_of(root) == [("lo", "A"), ("lo",)]
    assert extra_keys_of(child) is None  # vLLM salts only the block at token 0
    payload = encode_payload(batch("w", 0, root, child))
    for prefer_vllm in (True, False):
        dec, _ = make_decoder(prefer_vllm)
        evs = events_from_vllm(dec.decode(payload).events)
        assert evs[0] == root
        assert evs[1] == BlockStored((3,), 2, TOKS[2 * BS : 3 * BS], BS, None, None, None)


def test_mirror_propagates_the_tenant_along_the_chain() -> None:
    m = CacheMirror()
    root = BlockStored((1,), None, TOKS[:BS], BS, tenant="A")
    m.apply(root)
    child = m.with_chain_tenant(BlockStored((2,), 1, TOKS[BS : 2 * BS], BS))
    assert isinstance(child, BlockStored) and child.tenant == "A"
    m.apply(child)
    m.apply(BlockStored((3,), 2, TOKS[2 * BS : 3 * BS], BS))  # apply alone inherits too
    assert [e.tenant for e in m.dump()] == ["A", "A", "A"]
    other = BlockStored((5,), 99, TOKS[:BS], BS)  # unknown parent: unchanged
    assert m.with_chain_tenant(other) is other
