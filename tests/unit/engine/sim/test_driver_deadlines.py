"""SimEngine schedules steps on absolute deadlines: CPU time the driver spends per step (here: clock time
that passes inside `core.step`) is absorbed while it is shorter than the step, and slips time beyond that."""

from __future__ import annotations

import pytest

from kvmesh.core.generation import EngineRequest, SamplingParams
from kvmesh.engine.clock import VirtualClock
from kvmesh.engine.sim.core import SimConfig, StepResult
from kvmesh.engine.sim.driver import MAX_LAG_S, SimEngine
from kvmesh.engine.sim.perf import decode_step_time, step_time

pytestmark = pytest.mark.unit


async def delivery_times(overhead_s: float) -> tuple[list[float], list[float]]:
    """Clock time at which each output of a 3-token request arrives, and the perf model's step ends."""
    clock = VirtualClock()
    eng = SimEngine(SimConfig(block_size=16, num_blocks=512), clock=clock)
    step = eng.core.step

    def slow_step(now: float) -> StepResult:  # the driver's CPU time passes on the clock during the step
        clock.advance(overhead_s)
        return step(now)

    eng.core.step = slow_step  # type: ignore[method-assign]
    await eng.start()
    try:
        req = EngineRequest("a", tuple(range(1, 1500)), sampling=SamplingParams(max_tokens=3))
        got = [clock.now() async for _ in eng.generate(req)]
    finally:
        await eng.stop()
    ttft = step_time([(1024, 0)], []) + step_time([(475, 1024)], [])
    model = [ttft, ttft + decode_step_time(1, 1500), ttft + decode_step_time(1, 1500) + decode_step_time(1, 1501)]
    return got, model


@pytest.mark.parametrize("overhead_s", [0.0, 0.004])
async def test_per_step_overhead_shorter_than_a_step_is_absorbed(overhead_s: float) -> None:
    got, model = await delivery_times(overhead_s)
    assert overhead_s < min(b - a for a, b in zip([0.0, *model], model, strict=False))
    assert got == pytest.approx(model)


async def test_overhead_beyond_the_lag_cap_slips_time() -> None:
    over = 2 * MAX_LAG_S
    got, model = await delivery_times(over)
    # each of the 4 steps (2 prefill chunks, 2 decodes) runs late by at least over − MAX_LAG_S
    assert all(g >= m + k * (over - MAX_LAG_S) for k, (g, m) in enumerate(zip(got, model, strict=True), start=2))
