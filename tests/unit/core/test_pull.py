"""The one pull type (`kvmesh.core.pull.KvPull`): when the router's decision goes void."""

from __future__ import annotations

import pytest

from kvmesh.core.pull import KvPull

pytestmark = pytest.mark.unit


def test_a_pull_is_void_from_its_expiry_on() -> None:
    pull = KvPull("peer:1", "cpu", 8, expires_unix_ms=1_000)
    assert not pull.expired(999.5)
    assert pull.expired(1_000) and pull.expired(2_000)


def test_a_pull_without_an_expiry_never_goes_void() -> None:
    assert not KvPull("peer:1", "cpu", 8).expired(1e15)
