"""`kvmesh_asyncio_tasks`: the tasks alive in the event loop that serves /metrics, counted at scrape time."""

from __future__ import annotations

import asyncio
import math

from prometheus_client.parser import text_string_to_metric_families

from kvmesh.telemetry.metrics import _live_tasks, render_latest


def scraped() -> float:
    body, _ = render_latest()
    for family in text_string_to_metric_families(body.decode()):
        for sample in family.samples:
            if sample.name == "kvmesh_asyncio_tasks":
                return sample.value
    raise AssertionError("kvmesh_asyncio_tasks is not exposed")


async def test_a_scrape_on_the_loop_counts_its_live_tasks() -> None:
    before = scraped()
    stop = asyncio.Event()
    extra = [asyncio.create_task(stop.wait()) for _ in range(5)]
    assert scraped() == before + 5
    stop.set()
    await asyncio.gather(*extra)
    assert scraped() == before


def test_off_the_loop_it_is_not_a_number_rather_than_a_wrong_count() -> None:
    assert math.isnan(_live_tasks())
