"""Fixtures shared by unit tests."""

from __future__ import annotations

import pytest

from kvmesh.kvplane.kvsync import tier


@pytest.fixture(params=["kernel", "fallback"])
def kernel(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> str:
    """kv-sync's CRC32C path, run twice: the C kernel (`kvmesh.kvplane.kvsync._crc`) and the `crc32c` fallback."""
    if request.param == "kernel" and tier._kernel is None:
        pytest.skip("the CRC kernel is not built here (test_kernel_is_built_where_required covers CI)")
    if request.param == "fallback":
        monkeypatch.setattr(tier, "_kernel", None)
    return str(request.param)
