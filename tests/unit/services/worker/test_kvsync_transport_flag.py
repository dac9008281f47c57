"""The worker's --kvsync-transport: a value that is not a transport fails at start, naming the flag."""

from __future__ import annotations

import pytest

from kvmesh.core.errors import InvalidArgument
from services.worker.settings import WorkerSettings


def test_an_unknown_transport_fails_at_start_naming_the_flag() -> None:
    with pytest.raises(InvalidArgument, match="kvsync_transport") as e:
        WorkerSettings(kvsync_transport="rdma")
    assert "rdma" in str(e.value)
