"""`WorkerPool`: a worker whose load reports stop arriving (a frozen process keeps its connection open) is out
of rotation once its last report is older than the report-age bound, and back with its next report; the
clock is injected through `views(now)` / `routable_count(now)`."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest

from kvmesh.core.config import ServerSettings
from kvmesh.routing import InflightTracker
from kvmesh.services.router.workers import WorkerHandle, WorkerPool
from kvmesh.v1 import common_pb2, worker_pb2

pytestmark = pytest.mark.unit


async def reporting_pool(**kw: Any) -> tuple[WorkerPool, WorkerHandle]:
    pool = WorkerPool(["127.0.0.1:1"], ServerSettings(), InflightTracker(), **kw)
    (h,) = pool.handles
    pool._on_info(h, worker_pb2.GetInfoResponse(worker_id="w0", kv_blocks_total=100))
    pool._on_report(h, common_pb2.LoadReport())
    return pool, h


async def test_reports_that_stop_take_the_worker_out_of_rotation_within_the_bound() -> None:
    pool, h = await reporting_pool(load_interval_ms=200)  # 5 x 0.2 s = 1 s, the 5 s floor wins
    t0 = h.last_report_rx
    try:
        assert pool.stale_after_s == 5.0
        assert pool.routable_count(t0 + 4.9) == 1
        assert pool.routable_count(t0 + 5.1) == 0  # before: in rotation for 10 s without a report
        assert not pool.views(t0 + 5.1)[0].healthy
        pool._on_report(h, common_pb2.LoadReport())  # reports again: back in rotation
        assert pool.routable_count(h.last_report_rx + 0.1) == 1
    finally:
        await pool.stop()


async def test_the_report_age_bound_follows_the_interval_within_its_ceiling() -> None:
    pool, _ = await reporting_pool(load_interval_ms=1000, report_age_intervals=3, report_age_floor_s=0.5)
    slow, _ = await reporting_pool(load_interval_ms=5000, max_report_age_s=10.0)
    try:
        assert pool.stale_after_s == 3.0 and slow.stale_after_s == 10.0
    finally:
        await pool.stop()
        await slow.stop()


async def test_a_request_in_the_startup_window_waits_for_every_worker_first_report() -> None:
    """A new process of `--processes N` takes connections before it knows its workers: `settle` holds a request
    until every worker has reported once (it routed on a partial view, or answered "no worker available")."""
    pool = WorkerPool(["127.0.0.1:1", "127.0.0.1:2"], ServerSettings(), InflightTracker())
    await pool.start(settle_s=60.0)
    try:
        settling = asyncio.create_task(pool.settle())
        a, b = pool.handles
        for h, wid in ((a, "w0"), (b, "w1")):
            for _ in range(5):  # the loop runs: settle still waits on the worker not yet heard from
                await asyncio.sleep(0)
            assert not settling.done()
            pool._on_info(h, worker_pb2.GetInfoResponse(worker_id=wid, kv_blocks_total=100))
            pool._on_report(h, common_pb2.LoadReport())
        await asyncio.wait_for(settling, 5.0)  # both reported: it returns
    finally:
        await pool.stop()


async def test_past_the_startup_window_a_request_waits_for_no_one() -> None:
    pool = WorkerPool(["127.0.0.1:1"], ServerSettings(), InflightTracker())
    await pool.start(settle_s=0.0)
    try:
        await asyncio.wait_for(pool.settle(), 5.0)  # a worker that never reports does not hold requests
        assert not pool.ready.is_set()
    finally:
        await pool.stop()
