"""The rollout controller fails safe: an unexpected error while measuring rolls the canary back."""

from __future__ import annotations

import asyncio
from collections.abc import Mapping, Sequence
from pathlib import Path

import pytest

from kvmesh.discovery.model import ServiceInstance
from kvmesh.discovery.static import StaticRegistry
from kvmesh.discovery.watcher import DiscoveryWatcher
from kvmesh.ops.rollout.canary import CanaryThresholds, VersionSample
from kvmesh.ops.rollout.schedule import Phase, RolloutPlan
from kvmesh.services.failover.__main__ import make_policy
from kvmesh.services.failover.canary_probe import VersionProber
from kvmesh.services.failover.endpoint_sets import EndpointSetPublisher
from kvmesh.services.failover.rollout import RolloutController
from kvmesh.services.failover.settings import FailoverSettings

pytestmark = pytest.mark.unit


class BrokenProber(VersionProber):
    def __init__(self) -> None:
        super().__init__(lambda t: None, [[3]], 1, 1.0)  # type: ignore[arg-type,return-value]

    async def measure(self, workers: Mapping[str, Sequence[ServiceInstance]]) -> dict[str, VersionSample]:
        raise RuntimeError("probe bug")


async def test_an_error_in_a_check_rolls_back_to_the_weights_before(tmp_path: Path) -> None:
    publisher = EndpointSetPublisher(
        DiscoveryWatcher(StaticRegistry(tmp_path / "r.yaml")), make_policy(FailoverSettings(version_weights="v1=1"))
    )
    ctl = RolloutController(publisher, BrokenProber(), RolloutPlan(hold_s=0.0), CanaryThresholds(), 0.01)
    await ctl.start("v2", "v1")
    assert dict(publisher.policy.version_plan.weights) == {"v2": 0.05, "v1": 0.95}
    assert ctl._task is not None
    await asyncio.wait_for(ctl._task, 10)  # ends by itself: the rollout is over
    r = ctl.current
    assert (
        r is not None
        and r.phase is Phase.ROLLED_BACK
        and "controller error RuntimeError: probe bug" in r.events[-1].message
    )
    assert dict(publisher.policy.version_plan.weights) == {"v1": 1.0}
    await ctl.stop()
