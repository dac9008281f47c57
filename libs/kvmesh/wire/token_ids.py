"""A prompt's token ids in the one shape the router keeps them in, from the tokeniser (or the client's message)
to a worker's request: `TokenIdArray`, a read-only uint32 array (what block hashing and the index replica
read) together with its wire bytes, a serialised `kvmesh.v1.TokenIds` (what a worker request splices in).

Both are made once per request, from one `TokenIds` message: the array is read from the message's packed
buffer (a few µs for 8K ids, where a Python list costs hundreds), and the bytes are the ones the client sent
when there are any. A retry reuses them as they are; a migration adds only the tokens generated so far.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from kvmesh.v1 import common_pb2


class TokenIdArray:
    """Token ids as a read-only uint32 `array` and `wire`, the same ids as serialised `TokenIds` bytes."""

    __slots__ = ("array", "wire")

    def __init__(self, array: np.ndarray, wire: bytes) -> None:
        array.setflags(write=False)  # shared by every attempt of a request: nobody may change it under another
        self.array = array
        self.wire = wire

    @classmethod
    def of(cls, ids: Sequence[int]) -> TokenIdArray:
        """From ids within uint32 (ValueError otherwise: the caller checks a client's ids first)."""
        return cls.from_message(common_pb2.TokenIds(ids=ids))

    @classmethod
    def from_message(cls, msg: common_pb2.TokenIds, wire: bytes | None = None) -> TokenIdArray:
        """From a parsed message and, when known, the bytes it was parsed from (else it is serialised)."""
        return cls(np.array(msg.ids, dtype=np.uint32), msg.SerializeToString() if wire is None else wire)

    @classmethod
    def from_wire(cls, wire: bytes) -> TokenIdArray:
        """From serialised `TokenIds` bytes (a tokeniser cache's entry)."""
        return cls.from_message(common_pb2.TokenIds.FromString(wire), wire)

    def __len__(self) -> int:
        return len(self.array)

    def array_with(self, more: Sequence[int]) -> np.ndarray:
        """These ids followed by `more` (a migration's prompt: the tokens generated so far resume it)."""
        if not more:
            return self.array
        return np.concatenate([self.array, np.asarray(more, dtype=np.uint32)])
