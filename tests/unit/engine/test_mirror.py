"""The engine mirror keeps a block per medium: a reset of the engine's pool (`AllBlocksCleared`) drops the
pool's copies and leaves the host-tier copies (and their tenants) in its dumps."""

from __future__ import annotations

import pytest

from kvmesh.core.kvevents import AllBlocksCleared, BlockRemoved, BlockStored
from kvmesh.engine.mirror import CacheMirror

pytestmark = pytest.mark.unit
BS = 2


def test_a_pool_reset_keeps_the_tier_copies() -> None:
    m = CacheMirror()
    m.apply(BlockStored((1, 2, 3), None, (1, 2, 3, 4, 5, 6), BS, medium="GPU", tenant="t"))
    m.apply(BlockStored((2, 3), 1, (3, 4, 5, 6), BS, medium="CPU"))
    assert len(m) == 3 and len(m.dump()) == 5
    m.apply(AllBlocksCleared())
    assert len(m) == 0 and m.hashes() == {2, 3}
    assert [(e.block_hashes, e.medium, e.tenant) for e in m.dump()] == [((2,), "CPU", "t"), ((3,), "CPU", "t")]
    m.apply(BlockRemoved((2, 3), medium="CPU"))
    assert m.hashes() == set() and m.dump() == []
