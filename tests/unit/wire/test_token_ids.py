"""`TokenIdArray`: one prompt's ids as a read-only uint32 array and the `TokenIds` bytes of the same ids, made
once; a migration's prompt adds only the tokens generated so far."""

from __future__ import annotations

import numpy as np
import pytest

from kvmesh.v1 import common_pb2
from kvmesh.wire.token_ids import TokenIdArray

pytestmark = pytest.mark.unit


@pytest.mark.parametrize("ids", [[], [0], [1, 127, 128, 2**32 - 1], list(range(5000))])
def test_every_way_in_gives_the_same_array_and_bytes(ids: list[int]) -> None:
    wire = common_pb2.TokenIds(ids=ids).SerializeToString()
    for t in (
        TokenIdArray.of(ids),
        TokenIdArray.from_wire(wire),
        TokenIdArray.from_message(common_pb2.TokenIds(ids=ids)),
    ):
        assert t.array.dtype == np.uint32 and t.array.tolist() == ids and len(t) == len(ids)
        assert common_pb2.TokenIds.FromString(t.wire).ids == ids


def test_the_bytes_a_client_sent_are_kept_as_they_are() -> None:
    sent = common_pb2.TokenIds(ids=[1]).SerializeToString() + common_pb2.TokenIds(ids=[2]).SerializeToString()
    msg = common_pb2.TokenIds.FromString(sent)  # [1, 2], sent in two packed runs: not what serialising gives
    assert msg.SerializeToString() != sent
    t = TokenIdArray.from_message(msg, sent)
    assert t.wire == sent and t.array.tolist() == [1, 2]


def test_the_array_is_read_only_and_a_migration_adds_the_tokens_so_far() -> None:
    t = TokenIdArray.of([5, 6])
    with pytest.raises(ValueError, match="read-only"):
        t.array[0] = 1
    assert t.array_with([]) is t.array
    assert t.array_with([7, 8]).tolist() == [5, 6, 7, 8] and t.array.tolist() == [5, 6]
    with pytest.raises(ValueError):
        TokenIdArray.of([2**32])  # outside uint32: a client's ids are checked before they get here
