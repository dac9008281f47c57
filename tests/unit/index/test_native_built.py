"""The compiled index/hash kernel is what runs where a compiler exists (CI sets KVMESH_REQUIRE_NATIVE=1)."""

from __future__ import annotations

import os

import pytest

from kvmesh import index

pytestmark = pytest.mark.unit


@pytest.mark.skipif(os.environ.get("KVMESH_REQUIRE_NATIVE") != "1", reason="native build not required here")
def test_native_kernel_is_built_and_used() -> None:
    assert index.NATIVE, "kvmesh.index._native failed to build: the numpy fallback is in use"
    assert type(index.PrefixIndex()).__name__ == "NativePrefixIndex"
