"""Simulated engine: pure perf model (`perf`), block pool (`pool`), state machine (`core`), async `driver`."""

from kvmesh.engine.sim.core import SimConfig, SimEngineCore, StepResult
from kvmesh.engine.sim.perf import (
    H200_LLAMA70B_FP8,
    PerfModel,
    chunked_prefill_time,
    decode_step_time,
    prefill_time,
    step_time,
)

__all__ = [
    "H200_LLAMA70B_FP8",
    "PerfModel",
    "SimConfig",
    "SimEngineCore",
    "StepResult",
    "chunked_prefill_time",
    "decode_step_time",
    "prefill_time",
    "step_time",
]
