"""The cache-manager knows the medium of each (worker, block): a match splits into the leading run on the
worker's GPU and the rest in its host tiers, from the simulated engine's own events; copies on two media
count once per medium; a checkpoint keeps the media."""

from __future__ import annotations

import uuid
from collections.abc import Iterator

import pytest

from kvmesh.cachemgr.checkpoint import restore_state, snapshot_state
from kvmesh.cachemgr.core import CacheCore
from kvmesh.core.kvevents import BlockRemoved, BlockStored, KvEvent, KvEventBatch
from kvmesh.engine.sim.core import SimConfig, SimEngineCore
from kvmesh.engine.sim.tiers import HostTiers, sim_layout, tiny_block_bytes
from kvmesh.kvplane.kvsync.tier import TierRegion
from tests.unit.engine.sim.test_core import req, run

pytestmark = pytest.mark.unit
BS = 16
MODEL = "m"


@pytest.fixture
def region() -> Iterator[TierRegion]:
    r = TierRegion.create(f"kvm-test-{uuid.uuid4().hex[:12]}", tiny_block_bytes(BS), 64, "x")
    yield r
    r.close(unlink=True)


class Feed:
    """Numbers event lists into batches of one worker and applies them to a CacheCore."""

    def __init__(self, core: CacheCore, worker: str = "w1") -> None:
        self.core, self.worker, self.seq = core, worker, -1

    def __call__(self, events: list[KvEvent]) -> None:
        self.seq += 1
        res = self.core.apply(KvEventBatch(self.worker, "i1", self.seq, float(self.seq), tuple(events)))
        assert res.resync is None and res.applied == [self.seq]


def split(core: CacheCore, prompt: list[int]) -> tuple[int, int]:
    hashes = core.hashes_of(prompt)
    m = core.find_matches(hashes, 0.0)
    return m.get("w1", 0), core.tier_blocks(hashes, m).get("w1", 0)


def test_sim_engine_events_give_gpu_and_tier_blocks_per_worker(region: TierRegion) -> None:
    cm = CacheCore(BS, MODEL)
    feed = Feed(cm)
    eng = SimEngineCore(
        SimConfig(block_size=BS, num_blocks=12), tiers=HostTiers(region, None, sim_layout(MODEL, BS, 1))
    )
    a = [*range(1, 1 + 8 * BS), 5000]
    eng.add_request(req("a", a, max_tokens=1), 0.0)
    now, steps = run(eng)
    for s in steps:
        feed(s.kv_events)
    assert split(cm, a) == (8, 0)  # all on the GPU
    eng.add_request(req("b", [*range(20000, 20000 + 10 * BS), 7], max_tokens=1), now)
    now, steps = run(eng, now)
    for s in steps:
        feed(s.kv_events)
    matched, tier = split(cm, a)
    gpu_left = len(eng.pool.match_prefix([b.block_hash for _, b in eng.prefix_blocks(req("a", a))]))
    assert matched == 8 and tier == 8 - gpu_left and tier > 0  # the evicted tail is in the CPU tier
    eng.add_request(req("a2", a, max_tokens=1), now)
    _, steps = run(eng, now)
    for s in steps:
        feed(s.kv_events)
    assert split(cm, a) == (8, 0)  # loaded back: on the GPU again


def test_a_block_on_gpu_and_cpu_is_gpu_until_the_gpu_copy_goes() -> None:
    cm = CacheCore(BS, MODEL)
    feed = Feed(cm)
    toks = tuple(range(2 * BS))
    feed([BlockStored((11, 12), None, toks, BS, medium="GPU")])
    feed([BlockStored((12,), 11, toks[BS:], BS, medium="CPU")])  # an offloaded copy of block 2
    assert split(cm, [*toks, 1]) == (2, 0)
    feed([BlockRemoved((12,), medium="GPU")])
    assert split(cm, [*toks, 1]) == (2, 1)
    feed([BlockRemoved((12,), medium="CPU")])
    assert split(cm, [*toks, 1]) == (1, 0)


def test_media_survive_a_checkpoint() -> None:
    cm = CacheCore(BS, MODEL)
    feed = Feed(cm)
    toks = tuple(range(2 * BS))
    feed([BlockStored((11,), None, toks[:BS], BS, medium="GPU"), BlockStored((12,), 11, toks[BS:], BS, medium="CPU")])
    restored = restore_state(snapshot_state(cm.index, cm.ingestor, None), cm.hasher)
    hashes = cm.hashes_of(list(toks))
    assert restored.ingestor.gpu_run("w1", hashes, 2) == 1
