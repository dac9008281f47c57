"""Peer policies: each re-implemented formula on hand-made fleets where the answer is known."""

from __future__ import annotations

import pytest

from kvmesh.fleet.policies import ALL_POLICIES, make_policy
from kvmesh.fleet.policies.dynamo import Dynamo
from kvmesh.fleet.policies.llm_d import LlmD
from kvmesh.fleet.policies.session import SessionAffinity
from kvmesh.fleet.policies.sglang import SGLangCacheAware
from kvmesh.routing.types import RoutingQuery, WorkerView

pytestmark = pytest.mark.unit

IDS = ["a", "b", "c"]


def _views(**kw: dict[str, float]) -> list[WorkerView]:
    out = []
    for w in IDS:
        v = WorkerView(id=w)
        for field, per in kw.items():
            if w in per:
                setattr(v, field, per[w])
        out.append(v)
    return out


def _req(
    rid: str, hashes: list[int], prompt: int, matches: dict[str, int] | None = None, bs: int = 16, session: str = ""
) -> RoutingQuery:
    return RoutingQuery(rid, prompt, hashes, matches or {}, bs, session)


def test_dynamo_logit_is_overlap_weight_prefill_blocks_plus_decode_blocks() -> None:
    p = Dynamo()
    p.reset(IDS, 0)
    # worker b already runs a 10-block request that is decoding (prefill done)
    first = _req("r0", list(range(100, 110)), 160)
    p.on_routed(first, "b", 0.0)
    p.on_first_token("r0", "b", 0.1)
    req = _req("r1", [1, 2, 3, 4, 5, 6, 7, 8], 128 + 5, {"a": 2, "b": 5, "c": 8})
    # ⌈133/16⌉ = 9 blocks (8 full + 1 partial); prefill tokens = 133 − 16·overlap
    assert p.logits(req, _views()) == pytest.approx(
        [(133 - 32) / 16 + 9, (133 - 80) / 16 + 10 + 9, (133 - 128) / 16 + 9]
    )
    assert p.choose(req, _views(), 0.2) == "c"
    p.on_routed(req, "c", 0.2)
    # c now has 133 − 128 = 5 prefill tokens queued and 9 active blocks; shared blocks count once
    again = _req("r2", [1, 2, 3, 4, 5, 6, 7, 8], 133, {"c": 8})
    assert p.logits(again, _views())[2] == pytest.approx((5 + 5) / 16 + 9 + 1)
    p.on_finish("r1", "c", 1.0)
    p.on_finish("r0", "b", 1.0)
    assert p.logits(again, _views())[1] == pytest.approx(133 / 16 + 9)


def test_sglang_cache_threshold_smallest_tree_and_imbalance() -> None:
    p = SGLangCacheAware()
    p.reset(IDS, 0)
    r = _req("r0", [1, 2, 3, 4], 64)
    w0 = p.choose(r, _views(), 0.0)
    assert w0 == "a"  # empty trees: the smallest tree, first in order
    p.on_routed(r, w0, 0.0)
    # 3 of 4 blocks match (0.75 > 0.3): cache branch
    assert p.choose(_req("r1", [1, 2, 3, 9], 64), _views(), 0.0) == "a"
    # 1 of 4 blocks match (0.25 ≤ 0.3): smallest tree (b)
    assert p.choose(_req("r2", [1, 7, 8, 9], 64), _views(), 0.0) == "b"
    # imbalance: 65 in flight on a, 0 elsewhere → shortest queue even with a full match
    for i in range(65):
        p.on_routed(_req(f"x{i}", [1, 2, 3, 4], 64), "a", 0.0)
    assert p.choose(_req("r3", [1, 2, 3, 4], 64), _views(), 0.0) in ("b", "c")
    for i in range(65):
        p.on_finish(f"x{i}", "a", 1.0)
    assert p.choose(_req("r4", [1, 2, 3, 4], 64), _views(), 1.0) == "a"


def test_llm_d_weighted_scores() -> None:
    p = LlmD()
    p.reset(IDS, 0)
    req = _req("r", [1, 2, 3, 4], 64, {"a": 4, "b": 2})
    views = _views(waiting={"a": 4, "b": 0, "c": 2}, kv_usage={"a": 0.5, "b": 0.0, "c": 0.9})
    sc = p.scores(req, views)
    assert sc == pytest.approx([3 * 1.0 + 2 * 0.0 + 2 * 0.5, 3 * 0.5 + 2 * 1.0 + 2 * 1.0, 3 * 0.0 + 2 * 0.5 + 2 * 0.1])
    assert p.choose(req, views, 0.0) == "b"


def test_session_affinity_sticks_and_prefix_key_without_session() -> None:
    p = SessionAffinity()
    p.reset(IDS, 0)
    views = _views()
    owners = {p.choose(_req(f"r{i}", [9, 9], 32, session="s1"), views, 0.0) for i in range(5)}
    assert len(owners) == 1
    spread = {p.choose(_req(f"q{i}", [i, 100 + i, 7], 48, bs=512), views, 0.0) for i in range(40)}
    assert len(spread) == 3  # different prefixes spread over the ring


def test_every_policy_builds_and_routes() -> None:
    for name in ALL_POLICIES:
        p = make_policy(name)
        p.reset(IDS, 0)
        req = _req("r", [1, 2], 40, {"b": 2})
        w = p.choose(req, _views(), 0.0)
        assert w in IDS
        p.on_routed(req, w, 0.0)
        p.on_first_token("r", w, 0.1)
        p.on_finish("r", w, 0.2)
    with pytest.raises(ValueError):
        make_policy("nope")
