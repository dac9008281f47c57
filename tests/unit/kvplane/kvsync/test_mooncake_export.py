"""Whether a worker exports its tier through Mooncake's Transfer Engine: TE's reads are unauthenticated, so
`auto` exports only where no authorisation table is enforced; `mooncake` is the operator's word that TE's
network is fenced off; `shm` and `grpc` never export."""

from __future__ import annotations

import pytest

from kvmesh.core.errors import InvalidArgument
from kvmesh.kvplane.kvsync.transport import exports_mooncake
from services.worker.settings import WorkerSettings


@pytest.mark.parametrize(
    ("choice", "authorised", "exported"),
    [
        ("auto", False, True),
        ("auto", True, False),
        ("mooncake", True, True),
        ("mooncake", False, True),
        ("grpc", False, False),
        ("shm", False, False),
    ],
)
def test_the_tier_is_exported_over_mooncake_only_where_nothing_is_bypassed(
    choice: str, authorised: bool, exported: bool
) -> None:
    assert exports_mooncake(choice, authorised) is exported


def test_an_unknown_transport_fails_at_start_naming_the_flag() -> None:
    with pytest.raises(InvalidArgument, match="kvsync_transport") as e:
        WorkerSettings(kvsync_transport="rdma")
    assert "rdma" in str(e.value)
