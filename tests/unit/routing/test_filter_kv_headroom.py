"""kv-headroom: (kv_usage·T + inflight_kv_blocks + new_blocks) / T ≤ max_usage."""

import pytest

from kvmesh.routing.filters import KvHeadroomFilter
from kvmesh.routing.types import RoutingQuery, WorkerView

pytestmark = pytest.mark.unit


def test_boundary_is_inclusive_and_overlap_reduces_need() -> None:
    # T = 100 blocks of 16 tokens, 90 used; a 80-token prompt needs 5 blocks -> 95/100 = 0.95: kept
    w = WorkerView("a", kv_usage=0.90, kv_blocks_total=100)
    f = KvHeadroomFilter(max_usage=0.95)
    assert [x.id for x in f.filter(RoutingQuery("r", prompt_tokens=80, block_size=16), [w])] == ["a"]
    # one more token -> 6 blocks -> 0.96: dropped
    assert list(f.filter(RoutingQuery("r", prompt_tokens=81, block_size=16), [w])) == []
    # 2 blocks cached on a: only ceil((81-32)/16) = 4 new blocks -> kept
    req = RoutingQuery("r", prompt_tokens=81, block_size=16, matches={"a": 2})
    assert [x.id for x in f.filter(req, [w])] == ["a"]


def test_inflight_blocks_count_and_unknown_capacity_is_kept() -> None:
    f = KvHeadroomFilter()
    full = WorkerView("full", kv_usage=0.5, kv_blocks_total=100, inflight_kv_blocks=46)
    unknown = WorkerView("unknown")
    out = f.filter(RoutingQuery("r", prompt_tokens=1, block_size=16), [full, unknown])
    assert [x.id for x in out] == ["unknown"]


def test_include_output_counts_max_tokens() -> None:
    w = WorkerView("a", kv_usage=0.0, kv_blocks_total=10)
    req = RoutingQuery("r", prompt_tokens=16, block_size=16, max_tokens=160)
    assert len(KvHeadroomFilter().filter(req, [w])) == 1
    assert len(KvHeadroomFilter(include_output=True).filter(req, [w])) == 0


def test_rejects_bad_threshold() -> None:
    with pytest.raises(ValueError):
        KvHeadroomFilter(max_usage=1.5)
