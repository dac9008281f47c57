"""Pricing a pull against a recompute (`kvmesh.routing.pull.choose_pull`): a long prefix on a serving peer is
pulled, a short one, a peer without a tier, an unroutable peer or a worker that holds it already is not."""

from __future__ import annotations

import pytest

from kvmesh.engine.sim.perf import H200_LLAMA70B_FP8, chunked_prefill_time, kv_load_time, kv_pull_time
from kvmesh.routing.pull import choose_pull
from kvmesh.routing.types import RoutingQuery, WorkerView

pytestmark = pytest.mark.unit
BS = 16


def views(*, tier: bool = True, healthy: bool = True) -> list[WorkerView]:
    a = WorkerView(id="a", kvsync_address="127.0.0.1:9" if tier else "", tier_region="cpu", healthy=healthy)
    return [a, WorkerView(id="b", kvsync_address="127.0.0.1:8")]


def query(prompt_tokens: int, a_blocks: int, b_blocks: int = 0) -> RoutingQuery:
    return RoutingQuery("r", prompt_tokens, matches={"a": a_blocks, "b": b_blocks}, block_size=BS)


def test_a_long_prefix_on_a_peer_is_pulled_with_its_terms() -> None:
    c = choose_pull(query(4096 + 1, 256), "b", views())
    assert c is not None and c.source == "a" and c.blocks == 256 and c.tokens == 4096
    assert c.pull_s == pytest.approx(kv_pull_time(4096) + kv_load_time(4096))
    assert c.recompute_s == pytest.approx(chunked_prefill_time(4096, 0, 1024, H200_LLAMA70B_FP8))
    assert c.pull_s * 2 <= c.recompute_s


def test_only_the_blocks_the_target_lacks_and_never_the_last_token() -> None:
    c = choose_pull(query(4096, 256, 100), "b", views())  # the block of the last token is computed
    assert c is not None and c.blocks == 255 and c.tokens == (255 - 100) * BS


@pytest.mark.parametrize(
    ("q", "vs"),
    [
        (query(4096 + 1, 256, 256), views()),  # the target holds it already
        (query(4096 + 1, 256), views(tier=False)),  # the peer serves no tier
        (query(4096 + 1, 256), views(healthy=False)),  # the peer is out of rotation
    ],
)
def test_no_pull_without_a_better_serving_peer(q: RoutingQuery, vs: list[WorkerView]) -> None:
    assert choose_pull(q, "b", vs) is None


def test_the_margin_decides() -> None:
    c = choose_pull(query(4096 + 1, 256), "b", views(), margin=1.0)
    assert c is not None
    ratio = c.recompute_s / c.pull_s
    assert choose_pull(query(4096 + 1, 256), "b", views(), margin=ratio * 1.01) is None
