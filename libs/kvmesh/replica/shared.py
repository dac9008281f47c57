"""One index replica for the router processes of a host: one process follows the cache-manager, the others read.

`SharedReplicaIndex` is the `ReplicaIndex` the writer's `IndexFollower` keeps: its index is a
`SharedPrefixIndex` at `path`, the (worker, block) pairs held only in a host tier a second one at
`path.tier` (no Python sets), and after every change it publishes its completeness and revision in the
header (`kvmesh.index.shared`). `SharedReplicaView` answers `lookup` in the other processes from those files
as the writer would, or None when it cannot vouch for the answer: no writer yet, the copy not complete (a
snapshot, a break), the writer's heartbeat (`beat`) older than `stale_s` (the writer is gone and the copy
frozen), or no read that saw one state. The caller then asks the cache-manager (FindMatches), as a router
with a stale replica of its own does, unless the writer found that cache-manager disagreeing (`disagrees`).

    gpu(w) = first_held(w, h_0 … h_{total(w)-1}) in the tier index      (`kvmesh.replica.media.gpu_run`)
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any

import numpy as np

from kvmesh.index.shared import SharedIndexView, SharedPrefixIndex
from kvmesh.replica.index import ReplicaIndex
from kvmesh.replica.media import PrefixMatches
from kvmesh.v1 import cache_manager_pb2 as pb

__all__ = ["COMPLETE", "REVISION", "STALE_S", "TIER_SUFFIX", "SharedReplicaIndex", "SharedReplicaView"]

TIER_SUFFIX = ".tier"
# the writer's state, in the header words of its index (`kvmesh.index.shared`: 1-7 are the owner's)
COMPLETE, REVISION, HEARTBEAT_NS, DISAGREES = 1, 2, 3, 4
STALE_S = 2.0  # a writer silent this long is taken for gone (it beats every 0.5 s)
Hashes = Sequence[int] | np.ndarray


def _u64(hashes: Iterable[int]) -> np.ndarray:
    return np.fromiter(hashes, dtype=np.uint64)


def _gpu_runs(
    hashes: Hashes, total: Mapping[str, int], tier_pairs: int, first_held: Callable[[str, Hashes], int | None]
) -> dict[str, int] | None:
    """{worker: leading GPU run} (see the module docstring); None if a tier read failed."""
    if tier_pairs == 0:
        return dict(total)
    out: dict[str, int] = {}
    for w, m in total.items():
        at = first_held(w, hashes[:m])
        if at is None:
            return None
        out[w] = at
    return out


class SharedReplicaIndex(ReplicaIndex):
    """The writer's copy (see the module docstring)."""

    index: SharedPrefixIndex

    def __init__(self, path: str) -> None:
        self.path = path
        self.tier: SharedPrefixIndex | None = None
        self._beat_ns = 0
        super().__init__()

    def _new_index(self) -> SharedPrefixIndex:  # type: ignore[override]
        # a new index takes the header over with its state words at 0 (not complete) until `_publish`
        self.tier = SharedPrefixIndex(self.path + TIER_SUFFIX)
        return SharedPrefixIndex(self.path)

    def _tier_index(self) -> SharedPrefixIndex:
        assert self.tier is not None
        return self.tier

    def _add_tier(self, worker: str, hashes: Iterable[int]) -> None:
        self._tier_index().store(worker, None, _u64(hashes))

    def _clear_tier(self, worker: str) -> None:
        self._tier_index().clear(worker)

    def _drop_tier(self, worker: str, hashes: Iterable[int]) -> None:
        self._tier_index().remove(worker, _u64(hashes))

    def tier_pairs(self) -> int:
        return self._tier_index().num_pairs()

    def apply(self, msg: pb.WatchIndexResponse) -> None:
        super().apply(msg)
        self._publish()

    def interrupted(self) -> None:
        super().interrupted()
        self._publish()

    def load(self, d: dict[str, Any] | None) -> None:
        raise TypeError("a shared replica is rebuilt from its stream, not from a checkpoint")

    def export(self) -> dict[str, Any]:
        raise TypeError("a shared replica is not checkpointed")

    def _publish(self) -> None:
        self.index.set_word(HEARTBEAT_NS, self._beat_ns)  # a new index (a reset) starts with its words at 0
        self.index.set_word(REVISION, self.revision)
        self.index.set_word(COMPLETE, int(self.complete))

    def beat(self, now_ns: int, disagrees: bool = False) -> None:
        """The writer is alive at `now_ns` (CLOCK_MONOTONIC); `disagrees`: its cache-manager disagrees with the
        router's settings (not followed), so that readers do not ask it either."""
        self._beat_ns = now_ns
        self.index.set_word(DISAGREES, int(disagrees))
        self.index.set_word(HEARTBEAT_NS, now_ns)

    def lookup(self, hashes: Hashes) -> PrefixMatches:
        total = self.index.find_matches(hashes)
        gpu = _gpu_runs(hashes, total, self.tier_pairs(), self._tier_index().first_held)
        assert gpu is not None  # the writer's own reads never fail
        return PrefixMatches(gpu, total)


class SharedReplicaView:
    """A reader process's access to the writer's copy at `path` (see the module docstring)."""

    def __init__(self, path: str, stale_s: float = STALE_S) -> None:
        self.path, self.stale_s = path, stale_s
        self._index: SharedIndexView | None = None
        self._tier: SharedIndexView | None = None

    def refresh(self) -> bool:
        """Opens the writer's files when none are open yet or they were replaced; whether they are open."""
        if self._index is None or self._tier is None or self._index.replaced() or self._tier.replaced():
            try:
                self._index, self._tier = SharedIndexView(self.path), SharedIndexView(self.path + TIER_SUFFIX)
            except (OSError, ValueError):
                self._index = self._tier = None
        return self._index is not None

    def fresh(self, now_ns: int) -> bool:
        """The writer's copy is complete and the writer beat within `stale_s` of `now_ns`."""
        ix = self._index
        if ix is None or ix.word(COMPLETE) != 1:
            return False
        return now_ns - ix.word(HEARTBEAT_NS) < self.stale_s * 1e9

    @property
    def revision(self) -> int:
        return self._index.word(REVISION) if self._index is not None else 0

    @property
    def disagrees(self) -> bool:
        """The writer found the cache-manager disagreeing with the router's settings."""
        return self._index is not None and self._index.word(DISAGREES) == 1

    def tier_pairs(self) -> int:
        return self._tier.pairs() if self._tier is not None else 0

    def lookup(self, hashes: Hashes, now_ns: int) -> PrefixMatches | None:
        """As `ReplicaIndex.lookup`, or None (see the module docstring)."""
        ix, tier = self._index, self._tier
        if ix is None or tier is None or not self.fresh(now_ns):
            return None
        total = ix.find_matches(hashes)
        if total is None:
            return None
        gpu = _gpu_runs(hashes, total, self.tier_pairs(), tier.first_held)
        return None if gpu is None else PrefixMatches(gpu, total)
