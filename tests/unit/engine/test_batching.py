"""The length-aware batching window (`kvmesh.engine.batching`): classes and due times, release order
(shortest first, carried-over first), packing under the token budget, the bounded queue, cancellation."""

from __future__ import annotations

import pytest

from kvmesh.core.errors import InvalidArgument, ResourceExhausted
from kvmesh.engine.batching import BatchWindow, WindowConfig

pytestmark = pytest.mark.unit


def window(**kw: float) -> BatchWindow[str]:
    cfg = {"window_s": 0.05, "generation_window_s": 0.1, "generation_max_tokens": 256, "token_budget": 1000}
    cfg.update(kw)
    return BatchWindow(WindowConfig(**cfg))  # type: ignore[arg-type]


def test_class_decides_the_window_and_the_earliest_deadline_is_due() -> None:
    w = window()
    assert w.due() is None
    assert w.add("gen", 10, 512, now=1.0) == pytest.approx(1.1)  # generation: 100 ms
    assert w.add("unset", 10, None, now=1.0) == pytest.approx(1.1)  # no max_tokens: generation
    assert w.add("qa", 10, 32, now=1.02) == pytest.approx(1.07)  # QA: 50 ms, closes the window earlier
    assert w.due() == pytest.approx(1.07)
    assert WindowConfig(0.08).window_for(1000) == pytest.approx(0.16)  # default: twice the QA window


def test_release_is_shortest_first_and_packed_under_the_budget() -> None:
    w = window(token_budget=1000)
    for rid, n in (("a", 600), ("b", 100), ("c", 300), ("d", 300)):
        w.add(rid, n, 16, now=0.0)
    assert w.release(0.05) == ["b", "c", "d"]  # 100 + 300 + 300 = 700; + 600 would exceed 1000
    assert len(w) == 1 and "a" in w
    assert w.due() == pytest.approx(0.10)  # the carried request is due one window after the release


def test_carried_requests_go_first_so_long_prompts_are_not_starved() -> None:
    w = window(token_budget=1000)
    w.add("long", 900, 16, now=0.0)
    w.add("short1", 200, 16, now=0.0)
    assert w.release(0.05) == ["short1"]
    for i in range(5):
        w.add(f"new{i}", 50, 16, now=0.06)
    assert w.release(0.10) == ["long", "new0", "new1"]  # 900 first, then what still fits (1000 <= 1000)
    assert w.release(0.15) == ["new2", "new3", "new4"]


def test_a_prompt_over_the_budget_goes_alone() -> None:
    w = window(token_budget=100)
    w.add("huge", 5000, 16, now=0.0)
    w.add("small", 10, 16, now=0.0)
    assert w.release(0.05) == ["small"]
    assert w.release(0.10) == ["huge"]
    assert w.due() is None and len(w) == 0


def test_bounded_queue_and_duplicate_ids() -> None:
    w = window(max_waiting=2)
    w.add("a", 10, 16, now=0.0)
    with pytest.raises(InvalidArgument, match="already waiting"):
        w.add("a", 10, 16, now=0.0)
    w.add("b", 10, 16, now=0.01)
    with pytest.raises(ResourceExhausted) as ei:
        w.add("c", 10, 16, now=0.02)
    assert ei.value.retry_after_s == pytest.approx(0.03)  # until the release due at 0.05


def test_a_removed_request_is_never_released() -> None:
    w = window(token_budget=100)
    w.add("x", 80, 16, now=0.0)
    w.add("y", 90, 16, now=0.0)
    assert w.release(0.05) == ["x"]
    assert w.remove("y")  # carried over, then cancelled
    assert not w.remove("y")
    w.add("z", 10, 16, now=0.06)
    assert w.remove("z")
    assert w.release(0.2) == [] and w.due() is None


@pytest.mark.parametrize(
    "kw", [{"window_s": 0.0}, {"generation_window_s": -1.0}, {"token_budget": 0}, {"max_waiting": 0}]
)
def test_bad_settings_name_the_field(kw: dict[str, float]) -> None:
    with pytest.raises(InvalidArgument, match=next(iter(kw))):
        window(**kw)
