"""DiscoveryWatcher: last-known-good endpoints while the (stand-in) Consul is hung or dead, and restart."""

from __future__ import annotations

import time
from collections.abc import Callable
from pathlib import Path

import pytest

from kvmesh.discovery.consul import ConsulRegistry
from kvmesh.discovery.lkg import LastKnownGood
from kvmesh.discovery.model import Health, Role, ServiceInstance
from kvmesh.discovery.policy import FailoverPolicy
from kvmesh.discovery.registry import CheckSpec
from kvmesh.discovery.static import StaticRegistry
from kvmesh.discovery.watcher import DiscoveryWatcher
from kvmesh.discovery.zones import ZonePolicy
from tests.consul_standin.launch import start_standin

pytestmark = pytest.mark.integration


async def wait_until(w: DiscoveryWatcher, pred: Callable[[], bool], timeout_s: float = 10.0) -> None:
    deadline = time.monotonic() + timeout_s
    version = -1
    while not pred():
        left = deadline - time.monotonic()
        if left <= 0:
            raise AssertionError(f"not reached in {timeout_s}s: {w.status()} {w.snapshot}")
        version = await w.changed(version if version >= 0 else w.version, left)


def all_passing(w: DiscoveryWatcher, ids: set[str]) -> bool:
    by = w.snapshot.by_id()
    return ids <= set(by) and all(by[i].health is Health.PASSING for i in ids)


async def test_consul_hung_or_dead_keeps_serving_and_restart_starts_from_lkg(tmp_path: Path) -> None:
    sp = start_standin(data_dir=tmp_path / "consul")
    reg = ConsulRegistry(port=sp.port, request_timeout_s=1.0)
    ids = {"r-a-1", "cm-a-1", "w-a-1"}
    roles = {"r-a-1": Role.ROUTER, "cm-a-1": Role.CACHE_MANAGER, "w-a-1": Role.WORKER}
    watchers: list[DiscoveryWatcher] = []
    try:
        for iid in sorted(ids):
            await reg.register(
                ServiceInstance(iid, roles[iid], "a", "v1", "127.0.0.1", 7000), CheckSpec(mode="ttl", ttl_s=1.5)
            )
        lkg_path = tmp_path / "lkg.json"
        w1 = DiscoveryWatcher(
            ConsulRegistry(port=sp.port, request_timeout_s=1.0), LastKnownGood(lkg_path), wait_s=1.0, retry_max_s=0.3
        )
        watchers.append(w1)
        await w1.start()
        await wait_until(w1, lambda: w1.reachable is True and all_passing(w1, ids))
        served = w1.snapshot

        sp.pause()  # a hung agent: requests time out
        await wait_until(w1, lambda: w1.reachable is False, 10.0)
        assert w1.snapshot == served and w1.status().unreachable_since is not None
        decision = FailoverPolicy.create(ZonePolicy(), {"a": 1}, {"v1": 1}).observe(w1.snapshot, 0.0)
        assert decision.router_weights == {"r-a-1": 1.0}

        # a failover service (re)started while Consul is down serves the persisted endpoints at once
        w2 = DiscoveryWatcher(
            ConsulRegistry(port=sp.port, request_timeout_s=1.0), LastKnownGood(lkg_path), wait_s=1.0, retry_max_s=0.3
        )
        watchers.append(w2)
        await w2.start()
        assert w2.snapshot == served and w2.source == "last-known-good"
        await wait_until(w2, lambda: w2.reachable is False, 10.0)
        assert w2.snapshot == served

        sp.kill()  # dead, then back on the same port with its data dir
        sp = start_standin(port=sp.port, data_dir=tmp_path / "consul")
        await wait_until(w2, lambda: w2.reachable is True and w2.source == "registry" and all_passing(w2, ids), 15.0)
        await wait_until(w1, lambda: w1.reachable is True and all_passing(w1, ids), 15.0)
    finally:
        for w in watchers:
            await w.stop()
            await w.registry.close()
        await reg.close(deregister=False)
        sp.stop()


async def test_static_registry_worker_critical_leaves_rotation(tmp_path: Path) -> None:
    reg = StaticRegistry(tmp_path / "registry.yaml", poll_s=0.02)
    for iid, role in (("r", Role.ROUTER), ("cm", Role.CACHE_MANAGER), ("w1", Role.WORKER), ("w2", Role.WORKER)):
        await reg.register(ServiceInstance(iid, role, "a", "v1", "127.0.0.1", 1))
    w = DiscoveryWatcher(StaticRegistry(tmp_path / "registry.yaml", poll_s=0.02), None, wait_s=1.0)
    await w.start()
    try:
        await wait_until(w, lambda: len(w.snapshot.instances) == 4)
        await reg.register(ServiceInstance("w2", Role.WORKER, "a", "v1", "127.0.0.1", 1, Health.CRITICAL))
        await wait_until(w, lambda: w.snapshot.by_id()["w2"].health is Health.CRITICAL, 5.0)
        views = FailoverPolicy.create(ZonePolicy(), {"a": 1}, {"v1": 1}).observe(w.snapshot, 0.0).views
        assert [x.id for x in views["a"].workers] == ["w1"]
    finally:
        await w.stop()
