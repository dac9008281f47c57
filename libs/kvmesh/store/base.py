"""The checkpoint-store protocol shared by the file and Redis stores.

A store holds one snapshot (opaque bytes) and the log of records appended after it. Snapshots are
numbered by an *epoch*; records are appended to the log of the current epoch, and `save_snapshot` starts
a new epoch and drops the previous log in the same atomic step as the snapshot write. Recovery is
`load()` (snapshot + the records of its epoch, in order) followed by replaying the records. A record
appended after a snapshot was taken but before it was written lands in the new epoch's log; if the
process dies before the snapshot write, those records are lost, which the caller detects as a sequence
gap (the cache-manager's per-worker sequence numbers are part of the snapshot) and repairs by resync.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Protocol


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
