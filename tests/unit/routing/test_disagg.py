"""kvmesh's per-request prefill/decode decision (`kvmesh.routing.disagg.decide`): each condition of its formula."""

from __future__ import annotations

import pytest

from kvmesh.core.handoff import WorkerRole
from kvmesh.routing.disagg import PdParams, decide, link_factor
from kvmesh.routing.types import RoutingQuery, TransferCosts, WorkerView

pytestmark = pytest.mark.unit

BS = 512
S = 1.43e-4  # prefill seconds per token
COSTS = TransferCosts(prefill_s_per_token=S, block_load_s=0.002, block_pull_s=0.007, pull_rtt_s=0.001)


def _w(wid: str, role: WorkerRole, host: str = "", rack: str = "", queued: int = 0, decode: int = 0) -> WorkerView:
    return WorkerView(
        id=wid,
        role=role,
        host=host,
        rack=rack,
        prefill_tokens_queued=queued,
        decode_tokens_active=decode,
        transfer=COSTS,
    )


def _q(prompt: int, matches: dict[str, int] | None = None) -> RoutingQuery:
    return RoutingQuery("r", prompt, tuple(range(prompt // BS)), matches or {}, BS)


def test_short_prompt_is_served_aggregated() -> None:
    views = [_w("p", WorkerRole.PREFILL), _w("d", WorkerRole.DECODE)]
    d = decide(_q(200), views)
    assert not d.disaggregate and d.reason == "short-prefill"
    # long, but cached on the prefill worker but for 100 tokens: also short
    d = decide(_q(8 * BS + 100, {"p": 8}), views)
    assert not d.disaggregate and d.reason == "short-prefill" and d.terms["uncached_tokens"] == 100


def test_long_uncached_prompt_is_disaggregated_to_the_least_queued_prefill_worker() -> None:
    views = [
        _w("p0", WorkerRole.PREFILL, queued=20_000),
        _w("p1", WorkerRole.PREFILL),
        _w("d", WorkerRole.DECODE),
    ]
    d = decide(_q(16 * BS), views)
    assert d.disaggregate and d.reason == "disaggregate"
    assert (d.prefill_worker, d.decode_worker) == ("p1", "d")


def test_prefix_overlap_can_outweigh_a_prefill_queue() -> None:
    views = [_w("p0", WorkerRole.PREFILL, queued=2_000), _w("p1", WorkerRole.PREFILL), _w("d", WorkerRole.DECODE)]
    # p0 caches 15 of 16 blocks: 2,000 queued + 512 new tokens beat p1's 8,192 new ones
    d = decide(_q(16 * BS, {"p0": 15}), views)
    assert d.disaggregate and d.prefill_worker == "p0"


def test_busy_prefill_pool_prefills_in_place_when_that_is_sooner() -> None:
    busy = 20_000  # 2.86 s of queued prefill on the only prefill worker (> max_prefill_queue_s = 2 s)
    views = [_w("p", WorkerRole.PREFILL, queued=busy), _w("d", WorkerRole.DECODE)]
    d = decide(_q(8 * BS), views)
    assert not d.disaggregate and d.reason == "prefill-busy"
    assert d.terms["local_s"] < d.terms["remote_s"]
    # a longer queue on the decode worker: in place is not sooner, so it still goes to the prefill pool
    views = [_w("p", WorkerRole.PREFILL, queued=busy), _w("d", WorkerRole.DECODE, queued=busy + 1_000)]
    assert decide(_q(8 * BS), views).disaggregate
    # below the threshold the pool is not busy
    views = [_w("p", WorkerRole.PREFILL, queued=10_000), _w("d", WorkerRole.DECODE)]
    assert decide(_q(8 * BS), views).disaggregate


def test_locality_prefers_the_decode_worker_on_the_same_host_then_the_same_rack() -> None:
    p = _w("p", WorkerRole.PREFILL, host="h1", rack="r1")
    other_rack = _w("d0", WorkerRole.DECODE, host="h9", rack="r9")
    same_rack = _w("d1", WorkerRole.DECODE, host="h2", rack="r1")
    same_host = _w("d2", WorkerRole.DECODE, host="h1", rack="r1")
    pr = PdParams(same_rack=0.5)  # a rack's switch beats the spine
    assert decide(_q(16 * BS), [p, other_rack, same_rack, same_host], pr).decode_worker == "d2"
    assert decide(_q(16 * BS), [p, other_rack, same_rack], pr).decode_worker == "d1"
    assert link_factor(p, same_host, pr) < link_factor(p, same_rack, pr) < link_factor(p, other_rack, pr)
    # decode load still comes first: a loaded worker on the same host loses to an idle one on the rack
    loaded = _w("d2", WorkerRole.DECODE, host="h1", rack="r1", decode=60_000)
    assert decide(_q(16 * BS), [p, same_rack, loaded], pr).decode_worker == "d1"


def test_no_prefill_pool_is_aggregated() -> None:
    d = decide(_q(16 * BS), [_w("a", WorkerRole.BOTH), _w("b", WorkerRole.DECODE)])
    assert not d.disaggregate and d.reason == "no-prefill-pool"
