"""Signed requests at the edges of the replay window: ``|now − ts| ≤ window_s`` is inside (its last instant
on either side included), a hair past it is not, and the replay guard still remembers a signature at the
window's last instant (so the one instant the timestamp check lets through cannot replay it)."""

from __future__ import annotations

import pytest

from kvmesh.core.errors import Unauthenticated
from kvmesh.security.signing import DEFAULT_WINDOW_S, ReplayGuard, SignedRequest, sign, verify

pytestmark = pytest.mark.unit
SECRET = "s3cret"
BODY = b'{"prompt": "hi"}'
PATH = "/v1/completions"
T = 1_800_000_000
W = DEFAULT_WINDOW_S


def signed(ts: int = T) -> SignedRequest:
    return SignedRequest("POST", PATH, BODY, sign(SECRET, "POST", PATH, BODY, ts), str(ts))


def test_the_default_window_is_300_s() -> None:
    assert W == 300.0
    assert verify(SECRET, signed(), now=T + 300.0)[1] == T
    with pytest.raises(Unauthenticated, match=r"±300 s"):
        verify(SECRET, signed(), now=T + 301.0)


@pytest.mark.parametrize("now", [T + W, T - W, T + W - 0.001, T - W + 0.001, float(T)])
def test_the_window_s_last_instants_are_inside(now: float) -> None:
    raw, ts = verify(SECRET, signed(), now=now)
    assert ts == T and len(raw) == 32


@pytest.mark.parametrize("now", [T + W + 0.001, T - W - 0.001])
def test_a_hair_past_the_window_is_outside(now: float) -> None:
    with pytest.raises(Unauthenticated, match="outside the replay window"):
        verify(SECRET, signed(), now=now)


@pytest.mark.parametrize("window", [1.0, 60.0])
def test_a_custom_window_is_the_bound(window: float) -> None:
    assert verify(SECRET, signed(), now=T + window, window_s=window)[1] == T
    with pytest.raises(Unauthenticated, match=f"±{window:g} s"):
        verify(SECRET, signed(), now=T + window + 0.5, window_s=window)


def test_a_replay_at_the_window_s_last_instant_is_refused() -> None:
    guard = ReplayGuard(window_s=W)
    raw, ts = verify(SECRET, signed(), now=T)
    guard.admit(raw, ts, now=T)
    raw2, ts2 = verify(SECRET, signed(), now=T + W)  # the timestamp check still lets it in...
    with pytest.raises(Unauthenticated, match="replayed"):
        guard.admit(raw2, ts2, now=T + W)  # ...so the guard must still remember it
    assert len(guard) == 1


def test_a_signature_is_forgotten_just_after_its_window() -> None:
    guard = ReplayGuard(window_s=W)
    guard.admit(b"a" * 32, T, now=T)
    guard.admit(b"b" * 32, T + 10, now=T + 10)
    guard.admit(b"c" * 32, T + 300, now=T + W + 0.001)  # "a" expired (T + W < now), "b" not yet
    assert len(guard) == 2
    with pytest.raises(Unauthenticated, match="replayed"):
        guard.admit(b"b" * 32, T + 10, now=T + W + 0.001)


def test_a_refused_charge_is_not_remembered_and_the_guard_holds_exactly_capacity() -> None:
    guard = ReplayGuard(window_s=W, capacity=2)

    def refuse() -> None:
        raise RuntimeError("rate limited")

    with pytest.raises(RuntimeError):
        guard.admit(b"a" * 32, T, now=T, charge=refuse)
    assert len(guard) == 0
    guard.admit(b"a" * 32, T, now=T)  # re-sent after the refusal: admitted
    guard.admit(b"b" * 32, T + 1, now=T + 1)
    assert len(guard) == 2  # at capacity, nothing forgotten yet
    with pytest.raises(Unauthenticated):
        guard.admit(b"a" * 32, T, now=T + 2)
    guard.admit(b"c" * 32, T + 2, now=T + 2)  # over capacity: "a" (first to expire) is forgotten early
    assert len(guard) == 2
    guard.admit(b"a" * 32, T, now=T + 3)
    with pytest.raises(Unauthenticated):
        guard.admit(b"c" * 32, T + 2, now=T + 3)


def test_a_guard_of_capacity_one_still_refuses_the_replay() -> None:
    guard = ReplayGuard(window_s=W, capacity=1)
    guard.admit(b"a" * 32, T, now=T)
    assert len(guard) == 1
    with pytest.raises(Unauthenticated, match="replayed"):
        guard.admit(b"a" * 32, T, now=T + 1)
