"""The simulated engine's host tiers: evicted blocks move to the CPU tier (real bytes in a kv-sync region)
and come back as cached tokens at the modelled host->GPU cost; a corrupt block ends in a recompute; the
CPU tier demotes to a bounded disk tier; the events announce each block in one medium."""

from __future__ import annotations

import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest

from kvmesh.core.generation import EngineOutput
from kvmesh.core.kvevents import MEDIUM_CPU, MEDIUM_DISK, MEDIUM_GPU, BlockRemoved, BlockStored, KvEvent
from kvmesh.engine.mirror import CacheMirror
from kvmesh.engine.sim.core import SimConfig, SimEngineCore
from kvmesh.engine.sim.perf import kv_load_time
from kvmesh.engine.sim.tiers import (
    DiskTier,
    HostTiers,
    block_payload,
    sim_layout,
    tiny_block_bytes,
)
from kvmesh.kvplane.kvsync.tier import TierRegion
from tests.unit.engine.sim.test_core import finals, req, run

pytestmark = pytest.mark.unit
BS = 16


@pytest.fixture
def region() -> Iterator[TierRegion]:
    r = TierRegion.create(f"kvm-test-{uuid.uuid4().hex[:12]}", tiny_block_bytes(BS), 64, sim_layout("m", BS, 1))
    yield r
    r.close(unlink=True)


def make_core(cpu: TierRegion | None, disk: DiskTier | None = None, num_blocks: int = 12) -> SimEngineCore:
    tiers = HostTiers(cpu, disk, sim_layout("m", BS, tiny_block_bytes(BS)))
    return SimEngineCore(SimConfig(block_size=BS, num_blocks=num_blocks), tiers=tiers)


def events_of(steps: list) -> list[KvEvent]:  # type: ignore[type-arg]
    return [e for s in steps for e in s.kv_events]


def usage(out: EngineOutput) -> tuple[int, int]:
    assert out.usage is not None
    return out.usage.prompt_tokens, out.usage.cached_tokens


def test_tiny_block_bytes_is_the_tiny_models_kv_size() -> None:
    # 2 (K, V) x 2 layers x 2 KV heads x head_dim 32 x 2 bytes per token (scripts/build_tiny_model.py SPEC)
    assert tiny_block_bytes(32) == 2 * 2 * 2 * 32 * 32 * 2 == 16384


def test_evicted_prefix_comes_back_from_the_cpu_tier_as_cached_tokens(region: TierRegion) -> None:
    core = make_core(region)
    a = [*range(1, 1 + 8 * BS), 5000]
    core.add_request(req("a", a, max_tokens=1), 0.0)
    now, _ = run(core)
    # an unrelated prompt takes the whole pool: a's blocks leave the GPU
    core.add_request(req("b", [*range(20000, 20000 + 10 * BS), 7], max_tokens=1), now)
    now, steps_b = run(core, now)
    ev = events_of(steps_b)
    removed_gpu = {h for e in ev if isinstance(e, BlockRemoved) and e.medium == MEDIUM_GPU for h in e.block_hashes}
    stored_cpu = {h for e in ev if isinstance(e, BlockStored) and e.medium == MEDIUM_CPU for h in e.block_hashes}
    assert removed_gpu and removed_gpu == stored_cpu
    first: dict[int, int] = {}
    for i, e in enumerate(ev):
        for h in getattr(e, "block_hashes", ()):
            first.setdefault(h, i)
    assert all(isinstance(ev[first[h]], BlockRemoved) for h in removed_gpu)  # GPU removal precedes the CPU store
    core.add_request(req("a2", a, max_tokens=1), now)
    t0 = now
    now, steps_a2 = run(core, now)
    prompt, cached = usage(finals(steps_a2)["a2"])
    assert cached == 8 * BS and prompt == 8 * BS + 1
    assert core.loaded_tokens_total == len(stored_cpu) * BS  # the rest of the hit was still on the GPU
    # the admitting step paid the host->GPU copy of the loaded tokens on top of its compute
    assert steps_a2[0].duration_s >= kv_load_time(core.loaded_tokens_total, 0, core.config.perf)
    assert now > t0


def test_same_output_with_and_without_the_tier(region: TierRegion) -> None:
    prompt = [*range(100, 100 + 6 * BS), 1, 2]
    plain = SimEngineCore(SimConfig(block_size=BS, num_blocks=64))
    plain.add_request(req("x", prompt, max_tokens=5), 0.0)
    _, s_plain = run(plain)
    core = make_core(region, num_blocks=10)
    core.add_request(req("x", prompt, max_tokens=1), 0.0)
    now, _ = run(core)
    core.add_request(req("y", list(range(30000, 30000 + 8 * BS)), max_tokens=1), now)
    now, _ = run(core, now)
    core.add_request(req("x", prompt, max_tokens=5), now)
    _, s_tier = run(core, now)
    toks = lambda steps: [t for s in steps for o in s.outputs for t in o.token_ids]  # noqa: E731
    assert toks(s_tier) == toks(s_plain)
    assert usage(finals(s_tier)["x"])[1] == 6 * BS


def test_a_corrupt_tier_block_is_recomputed_from_there(region: TierRegion) -> None:
    core = make_core(region)
    a = [*range(1, 1 + 8 * BS), 5000]
    core.add_request(req("a", a, max_tokens=1), 0.0)
    now, _ = run(core)
    core.add_request(req("b", [*range(20000, 20000 + 10 * BS), 7], max_tokens=1), now)
    now, _ = run(core, now)
    assert core.tiers is not None
    digests = [d for d, _ in core.prefix_blocks(req("a", a))]
    assert core.tiers.prefix_run(digests) == 8
    view = region.get(digests[3], 0)
    assert view is not None
    view[100] ^= 0xFF  # a flipped byte in the CPU tier
    core.add_request(req("a3", a, max_tokens=1), now)
    _, steps = run(core, now)
    assert usage(finals(steps)["a3"])[1] == 3 * BS  # blocks 0-2 loaded, 3.. recomputed
    assert core.tiers.counters.load_failures == 1


def test_cpu_tier_demotes_to_a_bounded_disk_tier(tmp_path: Path) -> None:
    small = TierRegion.create(f"kvm-test-{uuid.uuid4().hex[:12]}", tiny_block_bytes(BS), 4, "x")
    try:
        disk = DiskTier(tmp_path / "tier", tiny_block_bytes(BS), 6)
        core = make_core(small, disk, num_blocks=12)
        mirror = CacheMirror()
        now = 0.0
        all_events: list[KvEvent] = []
        for k in range(4):  # four distinct 8-block prompts through a 12-block pool
            core.add_request(req(f"p{k}", [*range(k * 1000 + 1, k * 1000 + 1 + 8 * BS), 3], max_tokens=1), now)
            now, steps = run(core, now)
            all_events += events_of(steps)
        for e in all_events:
            mirror.apply(e)
        media = {e.medium for e in all_events if isinstance(e, BlockStored)}
        assert {MEDIUM_GPU, MEDIUM_CPU, MEDIUM_DISK} <= media
        assert len(list((tmp_path / "tier").glob("*.kv"))) <= 6
        # the events replay to: the pool's cached blocks + the blocks announced in the tiers, disjoint
        tier_hashes = {core.tiers.blocks[d][1].block_hash for d in core.tiers.announced}  # type: ignore[union-attr]
        assert not tier_hashes & core.pool.cached_hashes()
        assert mirror.hashes() == core.pool.cached_hashes() | tier_hashes
        # a disk-tier block is read back and verified
        d = next(d for d, (m, _) in core.tiers.blocks.items() if m == MEDIUM_DISK)  # type: ignore[union-attr]
        data = disk.get(d, 0)
        assert data is not None and bytes(data) == block_payload(d, tiny_block_bytes(BS))
    finally:
        small.close(unlink=True)


def test_disk_tier_detects_a_corrupt_file(tmp_path: Path) -> None:
    disk = DiskTier(tmp_path, 64, 2)
    d = bytes(range(32))
    assert disk.put(d, block_payload(d, 64), 0)
    path = tmp_path / f"{d.hex()}.kv"
    raw = bytearray(path.read_bytes())
    raw[10] ^= 1
    path.write_bytes(bytes(raw))
    assert disk.get(d, 0) is None and disk.contains_prefix([d]) == 0
