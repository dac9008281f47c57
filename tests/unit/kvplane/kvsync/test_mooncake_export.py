"""Whether a worker exports its tier through Mooncake's Transfer Engine: TE's reads are unauthenticated, so
`auto` exports only where no authorisation table is enforced; `mooncake` is the operator's word that TE's
network is fenced off; `shm` and `grpc` never export."""

from __future__ import annotations

import pytest

from kvmesh.kvplane.kvsync.transport import exports_mooncake


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
