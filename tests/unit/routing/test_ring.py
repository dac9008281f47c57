"""Consistent-hash ring: sessions stick; removing one of N workers moves only that worker's ~1/N."""

import collections

import pytest

from kvmesh.routing.ring import HashRing

pytestmark = pytest.mark.unit
KEYS = [f"session-{i}" for i in range(10_000)]


def test_lookup_is_stable_and_balanced() -> None:
    ring = HashRing([f"w{i}" for i in range(8)], vnodes=128)
    owners = [ring.lookup(k) for k in KEYS]
    assert owners == [ring.lookup(k) for k in KEYS]
    counts = collections.Counter(owners)
    assert len(counts) == 8
    assert max(counts.values()) < 1.35 * 10_000 / 8
    assert min(counts.values()) > 0.65 * 10_000 / 8


def test_remove_moves_only_the_removed_workers_keys() -> None:
    ring = HashRing([f"w{i}" for i in range(8)])
    before = {k: ring.lookup(k) for k in KEYS}
    ring.remove("w3")
    after = {k: ring.lookup(k) for k in KEYS}
    moved = [k for k in KEYS if before[k] != after[k]]
    assert all(before[k] == "w3" for k in moved)
    assert 0.08 < len(moved) / len(KEYS) < 0.18  # ~1/8
    ring.add("w3")
    assert {k: ring.lookup(k) for k in KEYS} == before


def test_allowed_subset_and_empty() -> None:
    ring = HashRing(["a", "b", "c"])
    assert ring.lookup("x", allowed={"b"}) == "b"
    assert ring.lookup("x", allowed=set()) is None
    assert HashRing().lookup("x") is None
    ring.sync(["a", "d"])
    assert ring.members == frozenset({"a", "d"})
