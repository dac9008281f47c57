"""Hypothesis strategies for domain KV events and batches (shared by the wire round-trip tests)."""

from __future__ import annotations

from hypothesis import strategies as st

from kvmesh.core.kvevents import AllBlocksCleared, BlockRemoved, BlockStored, KvEvent, KvEventBatch

u64 = st.integers(min_value=0, max_value=(1 << 64) - 1)
names = st.none() | st.text(min_size=1, max_size=8)


@st.composite
def block_stored(draw: st.DrawFn, tenant_on_children: bool = True) -> BlockStored:
    """A BlockStored; with `tenant_on_children` False a child (parent set) has no tenant, as on vLLM's wire."""
    bs = draw(st.integers(min_value=1, max_value=4))
    hashes = tuple(draw(st.lists(u64, min_size=1, max_size=4)))
    parent = draw(st.none() | u64)
    tokens = tuple(draw(st.lists(st.integers(0, (1 << 32) - 1), min_size=bs * len(hashes), max_size=bs * len(hashes))))
    tenant = draw(names) if parent is None or tenant_on_children else None
    return BlockStored(hashes, parent, tokens, bs, draw(names), draw(names), tenant)


def kv_event(tenant_on_children: bool = True) -> st.SearchStrategy[KvEvent]:
    """Any domain KV event."""
    removed = st.builds(BlockRemoved, st.lists(u64, max_size=4).map(tuple), names)
    return st.one_of(block_stored(tenant_on_children), removed, st.just(AllBlocksCleared()))


def kv_batch(tenant_on_children: bool = True, worker_id: str | None = None) -> st.SearchStrategy[KvEventBatch]:
    """A domain batch (worker id fixed when given: some wires do not carry it)."""
    wid = st.just(worker_id) if worker_id is not None else st.text(min_size=1, max_size=8)
    return st.builds(
        KvEventBatch,
        wid,
        st.text(min_size=1, max_size=8),
        st.integers(0, (1 << 62)),
        st.floats(allow_nan=False, allow_infinity=False, width=64),
        st.lists(kv_event(tenant_on_children), max_size=5).map(tuple),
        st.integers(0, 64),
    )
