"""A copy of a cache-manager's index, built from its WatchIndex messages (the router's replica, a followed zone).

Per stream: a snapshot (messages flagged `snapshot`, the first of them starting the copy from empty, the last
`snapshot_done`) or, when the stream resumed from this copy's revision, one `resumed` message; then live
deltas, one revision each. The copy keeps the index (`kvmesh.index.PrefixIndex`), per worker the blocks held
only in a host tier (`lookup` splits each match as the cache-manager does, `kvmesh.replica.media`), and the
revision and epoch it completely reflects: the resume point of the next stream (none, `epoch == ""`, while
a snapshot is half applied: a break then needs a new snapshot). `complete` is false from a break
(`interrupted`) until the next stream's snapshot or resume message; `export`/`load` carry the copy through
a checkpoint.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Any

import numpy as np

from kvmesh.index import PrefixIndex
from kvmesh.replica.media import PrefixMatches, split_matches
from kvmesh.v1 import cache_manager_pb2 as pb


class ReplicaIndex:
    """See the module docstring."""

    def __init__(self) -> None:
        self.index = self._new_index()
        self.tier_only: dict[str, set[int]] = {}  # per worker, blocks it holds only in a host tier (CPU/disk)
        self.revision = 0
        self.epoch = ""  # the followed cache-manager's revision numbering ('' = none yet: no resume point)
        self.complete = False
        self._in_snapshot = False
        self._stream_epoch = ""  # the epoch the current stream's first message named

    def interrupted(self) -> None:
        """The stream broke: the copy is kept (a resume point) but not complete until the next stream's start."""
        self.complete = False
        self._in_snapshot = False

    def reset(self) -> None:
        """Forget everything (a snapshot follows, or another cache-manager is followed)."""
        self.index = self._new_index()
        self.tier_only = {}
        self.revision, self.epoch = 0, ""
        self.interrupted()

    def apply(self, msg: pb.WatchIndexResponse) -> None:
        """Apply one WatchIndex message (the first message of a snapshot starts the copy from empty)."""
        if msg.snapshot and not self._in_snapshot:
            self.reset()
            self._in_snapshot = True
        self._stream_epoch = msg.epoch or self._stream_epoch
        idx = self.index
        for d in msg.deltas:
            w = d.worker_id
            if d.cleared:
                idx.clear(w)
                self._clear_tier(w)
            if d.removed:
                idx.remove(w, np.fromiter(d.removed, dtype=np.uint64, count=len(d.removed)))
                self._drop_tier(w, d.removed)
            if d.stored:
                parent = d.parent if d.HasField("parent") else None
                idx.store(w, parent, np.fromiter(d.stored, dtype=np.uint64, count=len(d.stored)))
            if d.tier_only:
                self._add_tier(w, d.tier_only)
            if d.on_gpu:
                self._drop_tier(w, d.on_gpu)
        if self._in_snapshot and not msg.snapshot_done:
            return  # half a snapshot: no resume point yet
        self.revision = msg.revision or self.revision
        self.epoch = self._stream_epoch or self.epoch
        if msg.snapshot_done or msg.resumed:
            self._in_snapshot = False
            self.complete = True

    def _new_index(self) -> PrefixIndex:
        return PrefixIndex()

    def _add_tier(self, worker: str, hashes: Iterable[int]) -> None:
        self.tier_only.setdefault(worker, set()).update(hashes)

    def _clear_tier(self, worker: str) -> None:
        self.tier_only.pop(worker, None)

    def _drop_tier(self, worker: str, hashes: Iterable[int]) -> None:
        only = self.tier_only.get(worker)
        if only:
            only.difference_update(hashes)

    def tier_pairs(self) -> int:
        """(worker, block) pairs the copy knows are only in a host tier."""
        return sum(len(s) for s in self.tier_only.values())

    def lookup(self, hashes: Sequence[int] | np.ndarray) -> PrefixMatches:
        """Each worker's match in the copy and its leading GPU run."""
        total = self.index.find_matches(hashes)
        return PrefixMatches(split_matches(hashes, total, self.tier_only), total)

    def export(self) -> dict[str, Any]:
        """The copy as a checkpoint stores it (msgpack-able)."""
        return {
            "index": self.index.snapshot(),
            "tier_only": [[w, sorted(s)] for w, s in self.tier_only.items() if s],
            "revision": self.revision,
            "epoch": self.epoch,
        }

    def load(self, d: dict[str, Any] | None) -> None:
        """Replace the copy by an `export` (None: empty), in place; not complete: the next stream resumes from
        its revision, or snapshots."""
        self.reset()
        if d is not None:
            self.index = PrefixIndex.restore(d["index"])
            self.tier_only = {str(w): {int(h) for h in hs} for w, hs in d["tier_only"]}
            self.revision, self.epoch = int(d["revision"]), str(d["epoch"])
