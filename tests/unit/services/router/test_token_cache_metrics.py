"""`kvmesh_router_tokenize_cache_*` read the router's tokenisation cache when scraped."""

from __future__ import annotations

import pytest
from prometheus_client import REGISTRY

from kvmesh.engine.token_cache import TokenCache
from kvmesh.services.router import metrics as m

pytestmark = pytest.mark.unit


def test_the_collector_reports_the_cache_it_points_at() -> None:
    cache = TokenCache(2**20)
    cache.put("a", b"\x01\x02")
    cache.get("a")
    cache.get("b")
    cache.stats.rejections = 3  # as a full cache counts them (tests/unit/engine/test_token_cache.py)
    before = m.TOKEN_CACHE.stats
    m.TOKEN_CACHE.stats = cache.stats
    try:
        got = {
            (s.name, s.labels.get("result", "")): s.value
            for fam in REGISTRY.collect()
            if fam.name.startswith("kvmesh_router_tokenize_cache")
            for s in fam.samples
        }
    finally:
        m.TOKEN_CACHE.stats = before
    assert got[("kvmesh_router_tokenize_cache_lookups_total", "hit")] == 1
    assert got[("kvmesh_router_tokenize_cache_lookups_total", "miss")] == 1
    assert got[("kvmesh_router_tokenize_cache_evictions_total", "")] == 0
    assert got[("kvmesh_router_tokenize_cache_rejections_total", "")] == 3
    assert got[("kvmesh_router_tokenize_cache_entries", "")] == 1
    assert got[("kvmesh_router_tokenize_cache_bytes", "")] == cache.stats.bytes > 0
