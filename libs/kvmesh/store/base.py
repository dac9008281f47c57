"""The checkpoint-store protocol shared by the file and Redis stores.

A store holds one snapshot (opaque bytes) and the log of records appended after it. Snapshots are
numbered by an *epoch*; records are appended to the log of the current epoch, and `save_snapshot` starts
a new epoch and drops the previous log in the same atomic step as the snapshot write. Recovery is
`load()` (snapshot + the records of its epoch, in order) followed by replaying the records. A record
appended after a snapshot was taken but before it was written lands in the new epoch's log; if the
process dies before the snapshot write, those records are lost, which the caller detects as a sequence
gap (the cache-manager's per-worker sequence numbers are part of the snapshot) and repairs by resync.

A store that cannot write says why in kvmesh's own errors, never its client library's: full (ENOSPC, Redis
at its memory limit) is `ResourceExhausted` with `RETRY_AFTER_S`, anything else on the way to it
`Unavailable`. A failed `save_snapshot` leaves the previous snapshot and log as they were; a failed `append`
may have written a prefix of its records (a torn tail ends the log there), never a later record after a
missing one.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Protocol

RETRY_AFTER_S = 5.0  # a full store: when to try again (space may be freed, a checkpoint shrinks the log)


@dataclass(slots=True)
class Loaded:
    """What `load` found: the snapshot (None if none yet), its epoch, and the records after it."""

    snapshot: bytes | None
    epoch: int
    records: list[bytes] = field(default_factory=list)


class CheckpointStore(Protocol):
    """Snapshot + event log (see module docstring)."""

    async def load(self) -> Loaded:
        """Read the latest snapshot and its log; later appends continue that epoch's log."""
        ...

    async def save_snapshot(self, snapshot: bytes) -> int:
        """Atomically replace the snapshot, start a new (empty) log; returns the new epoch."""
        ...

    async def append(self, records: Sequence[bytes]) -> None:
        """Append records to the current epoch's log (durable when this returns)."""
        ...

    async def close(self) -> None:
        """Release connections and files."""
        ...
