"""SimEngineCore under a virtual clock: prefix hits, evictions and events match the block pool exactly;
timings follow the perf model; admission control waits or refuses instead of overcommitting."""

from __future__ import annotations

import dataclasses
import math

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvmesh.core.errors import InvalidArgument, ResourceExhausted
from kvmesh.core.generation import EngineOutput, EngineRequest, SamplingParams
from kvmesh.core.kvevents import BlockRemoved, BlockStored
from kvmesh.engine.sim.core import SimConfig, SimEngineCore, StepResult
from kvmesh.engine.sim.perf import decode_step_time, step_time
from kvmesh.index.hashing import compute_block_hashes
from tests.unit.engine.sim.test_pool import replay

pytestmark = pytest.mark.unit
BS = 16


def req(rid: str, prompt: list[int], max_tokens: int = 4, **kw: object) -> EngineRequest:
    return EngineRequest(rid, tuple(prompt), sampling=SamplingParams(max_tokens=max_tokens), **kw)  # type: ignore[arg-type]


def run(core: SimEngineCore, now: float = 0.0, max_steps: int = 10_000) -> tuple[float, list[StepResult]]:
    steps: list[StepResult] = []
    for _ in range(max_steps):
        if not core.has_work():
            return now, steps
        r = core.step(now)
        now += r.duration_s
        steps.append(r)
    raise AssertionError("core did not drain")


def finals(steps: list[StepResult]) -> dict[str, EngineOutput]:
    return {o.request_id: o for s in steps for o in s.outputs if o.finished}


def test_prefix_hit_reports_cached_tokens_and_events_carry_tokens_and_hashes() -> None:
    core = SimEngineCore(SimConfig(block_size=BS, num_blocks=256))
    shared = list(range(1, 1 + 5 * BS))
    a = [*shared, 900, 901, 902]
    core.add_request(req("a", a, max_tokens=3), 0.0)
    now, steps = run(core)
    events = [e for s in steps for e in s.kv_events]
    stored = [e for e in events if isinstance(e, BlockStored)]
    assert stored[0].token_ids == tuple(a[: 5 * BS]) and stored[0].parent_block_hash is None
    want = [int(h) for h in compute_block_hashes(a[: 5 * BS], BS, 0)]
    assert list(stored[0].block_hashes) == want
    core.add_request(req("b", [*shared, 77, 78], max_tokens=2), now)
    _, steps_b = run(core, now)
    out = finals(steps_b)["b"]
    assert out.usage is not None and out.usage.cached_tokens == 5 * BS and out.usage.prompt_tokens == 5 * BS + 2
    assert replay(events + [e for s in steps_b for e in s.kv_events]) == core.pool.cached_hashes()


def test_fully_cached_prompt_still_computes_its_last_block() -> None:
    core = SimEngineCore(SimConfig(block_size=BS, num_blocks=64))
    p = list(range(1, 1 + 4 * BS))  # exactly 4 blocks
    core.add_request(req("a", p, max_tokens=1), 0.0)
    now, _ = run(core)
    core.add_request(req("b", p, max_tokens=1), now)
    _, steps = run(core, now)
    assert finals(steps)["b"].usage.cached_tokens == 3 * BS  # type: ignore[union-attr]


def test_timings_follow_the_model_under_a_virtual_clock() -> None:
    cfg = SimConfig(block_size=BS, num_blocks=4096)
    core = SimEngineCore(cfg)
    core.add_request(req("a", list(range(3000)), max_tokens=3), 0.0)
    now, steps = run(core)
    durations = [s.duration_s for s in steps]
    expected = [
        step_time([(1024, 0)], []),
        step_time([(1024, 1024)], []),
        step_time([(952, 2048)], []),  # the first token comes with the last chunk
        decode_step_time(1, 3001),
        decode_step_time(1, 3002),
    ]
    assert durations == pytest.approx(expected)
    assert now == pytest.approx(sum(expected))
    rep = core.load_report(now)
    assert rep.decode_latency_p95_ms == pytest.approx(expected[3] * 1000)  # nearest rank of 2 decode steps
    assert rep.decode_latency_p50_ms == pytest.approx(expected[3] * 1000)


def test_extra_step_time_lengthens_every_iteration_and_keeps_the_outputs() -> None:
    base, slow = (SimEngineCore(SimConfig(block_size=BS, num_blocks=4096, extra_step_s=x)) for x in (0.0, 0.025))
    for core in (base, slow):
        core.add_request(req("a", list(range(100)), max_tokens=3), 0.0)
    (t0, s0), (t1, s1) = run(base), run(slow)
    assert [b.duration_s + 0.025 for b in s0] == pytest.approx([s.duration_s for s in s1])
    assert t1 == pytest.approx(t0 + 0.025 * len(s0))
    assert [o.token_ids for s in s0 for o in s.outputs] == [o.token_ids for s in s1 for o in s.outputs]


def test_an_output_salt_changes_the_tokens_not_the_timing() -> None:
    cores = [SimEngineCore(SimConfig(block_size=BS, num_blocks=4096, output_salt=x)) for x in (0, 0, 7)]
    for core in cores:
        core.add_request(req("a", list(range(100)), max_tokens=8), 0.0)
    (t0, s0), (_, s1), (t2, s2) = (run(c) for c in cores)
    tokens = [[t for s in steps for o in s.outputs for t in o.token_ids] for steps in (s0, s1, s2)]
    assert tokens[0] == tokens[1] and len(tokens[2]) == 8 and not set(tokens[0]) & set(tokens[2])
    assert t0 == pytest.approx(t2)


def test_lru_eviction_emits_removed_events_that_match_the_pool() -> None:
    core = SimEngineCore(SimConfig(block_size=BS, num_blocks=20, kv_admission_threshold=1.0))
    events = []
    now = 0.0
    for i in range(6):  # 6 distinct prompts of 5 blocks into a 20-block pool
        core.add_request(req(f"r{i}", [1000 * (i + 1) + t for t in range(5 * BS)], max_tokens=1), now)
        now, steps = run(core, now)
        events += [e for s in steps for e in s.kv_events]
        assert replay(list(events)) == core.pool.cached_hashes()
    removed = [h for e in events if isinstance(e, BlockRemoved) for h in e.block_hashes]
    assert core.pool.evictions == len(removed) > 0
    # the oldest prompt went first: none of r0's blocks survive, all of r5's do
    r0 = {int(h) for h in compute_block_hashes([1000 + t for t in range(5 * BS)], BS, 0)}
    r5 = {int(h) for h in compute_block_hashes([6000 + t for t in range(5 * BS)], BS, 0)}
    assert not r0 & core.pool.cached_hashes() and r5 <= core.pool.cached_hashes()


def test_admission_waits_above_95_percent_and_refuses_when_queue_full() -> None:
    core = SimEngineCore(SimConfig(block_size=BS, num_blocks=100, max_waiting=2))
    core.add_request(req("big", list(range(60 * BS - 1)), max_tokens=50), 0.0)  # 60 blocks
    core.step(0.0)
    core.add_request(req("next", [5000 + t for t in range(40 * BS - 1)], max_tokens=2), 0.0)  # 40 blocks
    now = 0.0
    for _ in range(10):
        r = core.step(now)
        now += r.duration_s
        rep = core.load_report(now)
        assert rep.running == 1 and rep.waiting == 1  # 60 + 40 > 95: it waits
        assert rep.kv_blocks_used <= 95
    core.add_request(req("q2", [1, 2, 3]), now)
    with pytest.raises(ResourceExhausted) as ei:
        core.add_request(req("q3", [1, 2, 3]), now)
    assert ei.value.retry_after_s > 0
    assert core.load_report(now).error_rate == pytest.approx(1 / 4)  # 3 accepted, 1 refused
    _, steps = run(core, now)
    assert set(finals(steps)) == {"big", "next", "q2"}
    assert core.pool.num_used == 0


def test_tenants_and_adapters_never_share_blocks() -> None:
    core = SimEngineCore(SimConfig(block_size=BS, num_blocks=256))
    p = list(range(1, 1 + 4 * BS + 1))
    now = 0.0
    hits = {}
    for rid, tenant, lora in [
        ("a1", "A", None),
        ("b1", "B", None),
        ("a2", "A", None),
        ("n1", None, None),
        ("l1", "A", "ad1"),
    ]:
        core.add_request(
            EngineRequest(rid, tuple(p), sampling=SamplingParams(max_tokens=1), tenant=tenant, lora_name=lora), now
        )
        now, steps = run(core, now)
        hits[rid] = finals(steps)[rid].usage.cached_tokens  # type: ignore[union-attr]
    assert hits == {"a1": 0, "b1": 0, "a2": 4 * BS, "n1": 0, "l1": 0}


def test_invalid_arguments() -> None:
    core = SimEngineCore(SimConfig(block_size=BS, num_blocks=64, max_model_len=256))
    bad = [
        (SamplingParams(max_tokens=0), "max_tokens"),
        (SamplingParams(max_tokens=9000), "max_tokens"),
        (SamplingParams(temperature=-1.0), "temperature"),
        (SamplingParams(top_p=0.0), "top_p"),
        (SamplingParams(top_k=-5), "top_k"),
        (SamplingParams(presence_penalty=3.0), "presence_penalty"),
    ]
    for sp, field in bad:
        with pytest.raises(InvalidArgument) as ei:
            core.add_request(EngineRequest("x", (1, 2, 3), sampling=sp), 0.0)
        assert ei.value.field == field
    with pytest.raises(InvalidArgument) as ei:
        core.add_request(req("long", list(range(300))), 0.0)
    assert ei.value.field == "prompt"
    with pytest.raises(InvalidArgument) as ei:
        core.add_request(req("room", list(range(250)), max_tokens=10), 0.0)  # 250 + 10 > 256
    assert ei.value.field == "max_tokens"
    core.add_request(req("dup", [1]), 0.0)
    with pytest.raises(InvalidArgument) as ei:
        core.add_request(req("dup", [1]), 0.0)
    assert ei.value.field == "request_id"
    small = SimEngineCore(SimConfig(block_size=BS, num_blocks=10))
    with pytest.raises(InvalidArgument) as ei:
        small.add_request(req("kv", list(range(200))), 0.0)  # 13 blocks > 95 % of 10: can never run here
    assert ei.value.field == "prompt_token_ids"
    vocab = SimConfig().vocab_size
    for bad_ids in ([5, vocab, 7], [-1, 4], [vocab + 10**6]):
        with pytest.raises(InvalidArgument) as ei:
            core.add_request(req(f"v{bad_ids[0]}", bad_ids), 0.0)
        assert ei.value.field == "prompt_token_ids" and str(vocab) in ei.value.message
    core.add_request(req("edge", [0, vocab - 1]), 0.0)  # both ends of the range are valid


def test_max_tokens_guard_defaults_to_limit_and_context() -> None:
    core = SimEngineCore(SimConfig(block_size=BS, num_blocks=1024, max_model_len=1000))
    core.add_request(EngineRequest("a", tuple(range(990)), sampling=SamplingParams(max_tokens=None)), 0.0)
    _, steps = run(core)
    out = finals(steps)["a"]
    assert out.finish_reason == "length" and out.usage.completion_tokens == 10  # type: ignore[union-attr]


def test_abort_releases_blocks_and_prefill_only_caches_without_sampling() -> None:
    core = SimEngineCore(SimConfig(block_size=BS, num_blocks=64))
    core.add_request(req("a", list(range(100)), max_tokens=100), 0.0)
    core.step(0.0)
    assert core.pool.num_used > 0
    out = core.abort("a", 1.0)
    assert out is not None and out.finish_reason == "abort" and core.pool.num_used == 0
    assert core.abort("a", 1.0) is None
    core.add_request(req("w", [7] * 64, prefill_only=True), 1.0)
    _, steps = run(core, 1.0)
    (o,) = [o for s in steps for o in s.outputs]
    assert o.finish_reason == "prefill_only" and o.token_ids == () and core.pool.num_cached >= 4


def test_preemption_under_memory_pressure_keeps_events_consistent() -> None:
    core = SimEngineCore(SimConfig(block_size=BS, num_blocks=12, kv_admission_threshold=1.0))
    events = []
    for i in range(3):
        core.add_request(req(f"p{i}", [100 * (i + 1) + t for t in range(3 * BS - 1)], max_tokens=40), 0.0)
    _, steps = run(core)
    events = [e for s in steps for e in s.kv_events]
    assert core.preemptions_total > 0
    assert {o.request_id for o in finals(steps).values() if o.finish_reason == "length"} == {"p0", "p1", "p2"}
    assert replay(events) == core.pool.cached_hashes() and core.pool.num_used == 0


def test_export_import_between_engines() -> None:
    a = SimEngineCore(SimConfig(block_size=BS, num_blocks=64))
    b = SimEngineCore(SimConfig(block_size=BS, num_blocks=64))
    prompt = list(range(3 * BS + 5))
    a.add_request(req("a", prompt, max_tokens=1), 0.0)
    run(a)
    hashes = [int(h) for h in compute_block_hashes(prompt, BS, 0)]
    blocks = a.export_blocks(hashes)
    assert [x.block_hash for x in blocks] == hashes
    assert b.import_blocks(blocks) == 3
    assert [e.block_hashes for e in b.drain_events() if isinstance(e, BlockStored)] == [(h,) for h in hashes]
    b.add_request(req("b", prompt, max_tokens=1), 0.0)
    _, steps = run(b)
    assert finals(steps)["b"].usage.cached_tokens == 3 * BS  # type: ignore[union-attr]
    forged = dataclasses.replace(blocks[0], block_hash=blocks[0].block_hash ^ 1)
    with pytest.raises(InvalidArgument):
        b.import_blocks([forged])  # hash does not match the tokens
    tampered = type(blocks[0])(blocks[0].block_hash, None, blocks[0].token_ids, b"x", blocks[0].digest, 1)
    with pytest.raises(InvalidArgument):
        b.import_blocks([tampered])


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    st.lists(
        st.tuples(st.integers(0, 3), st.integers(1, 70), st.integers(1, 6), st.booleans()),
        min_size=1,
        max_size=14,
    ),
    st.integers(8, 40),
)
def test_property_events_replay_to_pool_and_usage_is_bounded(
    reqs: list[tuple[int, int, int, bool]], num_blocks: int
) -> None:
    """Random shared-prefix workloads: after every step the event log replays to exactly the cached set,
    referenced blocks never exceed the pool, every request finishes, and nothing leaks."""
    core = SimEngineCore(
        SimConfig(
            block_size=4,
            num_blocks=num_blocks,
            max_batched_tokens=64,
            prefill_chunk_tokens=16,
            kv_admission_threshold=0.95,
        )
    )
    cached: set[int] = set()
    admitted = 0
    now = 0.0
    for i, (prefix, length, max_tokens, abort) in enumerate(reqs):
        prompt = [prefix * 10 + (t % 3) for t in range(length)]
        try:
            core.add_request(req(f"r{i}", prompt, max_tokens=max_tokens), now)
            admitted += 1
        except InvalidArgument:
            assert math.ceil((length + 1) / 4) > 0.95 * num_blocks
            continue
        r = core.step(now)
        now += r.duration_s
        replay(r.kv_events, cached)
        assert cached == core.pool.cached_hashes()
        if abort:
            core.abort(f"r{i}", now)
    _, steps = run(core, now)
    for s in steps:
        replay(s.kv_events, cached)
    assert cached == core.pool.cached_hashes()
    assert core.pool.num_used == 0 and not core.has_work()


def test_token_range_check_can_be_left_to_the_caller() -> None:
    """`check_token_range=False` is the fleet simulator's flag: it range-checks prompts itself, vectorised."""
    cfg = SimConfig(block_size=4, num_blocks=64, vocab_size=100)
    with pytest.raises(InvalidArgument, match="token ids"):
        SimEngineCore(cfg).add_request(EngineRequest("a", prompt_token_ids=(1, 100)), 0.0)
    trusting = SimEngineCore(dataclasses.replace(cfg, check_token_range=False))
    trusting.add_request(EngineRequest("a", prompt_token_ids=(1, 100)), 0.0)
    assert trusting.request_ids() == ["a"]


@pytest.mark.parametrize("seed", [None, 7])
def test_a_resumed_request_continues_with_the_tokens_of_a_fault_free_run(seed: int | None) -> None:
    # a migrated request comes back with its output so far appended to its prompt (`resumed_output_tokens`):
    # its next tokens are the fault-free run's, greedy (seeded by its own prompt, not the resumed one) or seeded
    prompt = list(range(100, 200))
    sampling = SamplingParams(max_tokens=8, temperature=0.0 if seed is None else 1.0, seed=seed)
    whole = SimEngineCore(SimConfig(block_size=BS, num_blocks=256))
    whole.add_request(EngineRequest("a", tuple(prompt), sampling=sampling), 0.0)
    tokens = [t for s in run(whole)[1] for o in s.outputs for t in o.token_ids]
    assert len(tokens) == 8
    resumed = SimEngineCore(SimConfig(block_size=BS, num_blocks=256))
    rest = dataclasses.replace(sampling, max_tokens=5)
    resumed.add_request(EngineRequest("b", tuple(prompt + tokens[:3]), sampling=rest, resumed_output_tokens=3), 0.0)
    assert [t for s in run(resumed)[1] for o in s.outputs for t in o.token_ids] == tokens[3:]
