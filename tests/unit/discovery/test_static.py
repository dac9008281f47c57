"""StaticRegistry (YAML file) and last-known-good persistence: file I/O in tmp_path, no processes."""

from __future__ import annotations

import asyncio
import time
from pathlib import Path

import pytest

from kvmesh.core.errors import NotFound
from kvmesh.discovery.lkg import LastKnownGood, LkgRecord
from kvmesh.discovery.model import CatalogSnapshot, Health, Role, ServiceInstance
from kvmesh.discovery.static import StaticRegistry

pytestmark = pytest.mark.unit


def inst(iid: str, role: Role = Role.WORKER, zone: str = "a", health: Health = Health.PASSING) -> ServiceInstance:
    return ServiceInstance(iid, role, zone, "v1", "127.0.0.1", 5000, health, 2.0, {"k": "v"})


async def test_register_deregister_roundtrip_through_the_file(tmp_path: Path) -> None:
    path = tmp_path / "reg.yaml"
    a, b = StaticRegistry(path), StaticRegistry(path)  # two processes sharing one file
    await a.register(inst("w1"))
    await a.register(inst("r1", Role.ROUTER))
    _, snap = await b.snapshot()
    assert sorted(snap.by_id()) == ["r1", "w1"]
    assert snap.by_id()["w1"] == inst("w1")
    await b.deregister("w1")
    _, snap = await a.snapshot()
    assert sorted(snap.by_id()) == ["r1"]
    with pytest.raises(NotFound):
        await a.deregister("w1")


async def test_watch_returns_on_operator_edit_and_times_out_otherwise(tmp_path: Path) -> None:
    path = tmp_path / "reg.yaml"
    reg = StaticRegistry(path, poll_s=0.02)
    await reg.register(inst("w1"))
    idx, _ = await reg.snapshot()
    t0 = time.monotonic()
    idx2, _ = await reg.watch(idx, 0.3)
    assert idx2 == idx and time.monotonic() - t0 >= 0.28

    watch = asyncio.create_task(reg.watch(idx, 10.0))
    path.write_text(
        "instances:\n  - {id: w1, role: worker, zone: a, version: v1, address: 127.0.0.1, port: 5000,"
        " health: critical, capacity: 2, meta: {k: v}}\n"
    )
    idx3, snap = await asyncio.wait_for(watch, 5.0)
    assert idx3 > idx and snap.by_id()["w1"].health is Health.CRITICAL


async def test_malformed_edit_keeps_last_good_content(tmp_path: Path) -> None:
    path = tmp_path / "reg.yaml"
    reg = StaticRegistry(path)
    await reg.register(inst("w1"))
    idx, snap = await reg.snapshot()
    path.write_text("instances: [ {id: broken")
    idx2, snap2 = await reg.snapshot()
    assert (idx2, snap2) == (idx, snap)
    path.write_text("instances:\n  - {id: x, role: nope, port: 1}\n")
    assert (await reg.snapshot())[1] == snap


def test_lkg_roundtrip_and_corrupt_file(tmp_path: Path) -> None:
    lkg = LastKnownGood(tmp_path / "lkg.json")
    assert lkg.load() is None
    rec = LkgRecord(42, CatalogSnapshot.of([inst("w1"), inst("r1", Role.ROUTER, "b", Health.WARNING)]), 123.5)
    lkg.save(rec)
    assert lkg.load() == rec
    (tmp_path / "lkg.json").write_text('{"version": 1, "index": 1')
    assert lkg.load() is None
    (tmp_path / "lkg.json").write_text('{"version": 99, "index": 1, "saved_at": 0, "instances": []}')
    assert lkg.load() is None
