"""Shared types of the cache-manager's ingestion: the index protocol it writes to, deltas, decisions."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Protocol


class IndexWriter(Protocol):
    """The subset of `kvmesh.index.PrefixIndex` that ingestion writes to (index hashes, never engine hashes)."""

    def store(self, worker: str, parent: int | None, hashes: Sequence[int]) -> object: ...

    def remove(self, worker: str, hashes: Sequence[int]) -> object: ...

    def clear(self, worker: str) -> object: ...


class BlockHasher(Protocol):
    """Derives index hashes for a run of full blocks chained after `parent` (an index hash, None = root).

    `lora_name` and `tenant` salt a root; a chained run inherits its parent's salt.
    """

    def chain(
        self,
        parent: int | None,
        token_ids: Sequence[int],
        block_size: int,
        lora_name: str | None,
        tenant: str | None = None,
    ) -> list[int]: ...


@dataclass(frozen=True, slots=True)
class Stored:
    """Index delta: `worker` now holds `hashes`, chained after `parent`."""

    worker: str
    parent: int | None
    hashes: tuple[int, ...]


@dataclass(frozen=True, slots=True)
class Removed:
    """Index delta: `worker` no longer holds `hashes`."""

    worker: str
    hashes: tuple[int, ...]


@dataclass(frozen=True, slots=True)
class Cleared:
    """Index delta: every entry of `worker` was dropped."""

    worker: str


@dataclass(frozen=True, slots=True)
class Media:
    """Index delta: `worker` now holds `tier_only` only in a host tier, and `on_gpu` on its GPU again."""

    worker: str
    tier_only: tuple[int, ...] = ()
    on_gpu: tuple[int, ...] = ()


IndexDelta = Stored | Removed | Cleared | Media


@dataclass(frozen=True, slots=True)
class ResyncRequest:
    """What the transport must obtain from a worker: a replay from `from_sequence`, or a full dump."""

    worker_id: str
    instance_id: str
    from_sequence: int
    full_dump: bool
    reason: str


@dataclass(slots=True)
class IngestResult:
    """Outcome of feeding one batch (or marker): sequences applied, ignored, deltas, an optional resync."""

    applied: list[int] = field(default_factory=list)
    ignored: list[tuple[int, str]] = field(default_factory=list)
    buffered: list[int] = field(default_factory=list)
    deltas: list[IndexDelta] = field(default_factory=list)
    resync: ResyncRequest | None = None
    gap: bool = False
    restart: bool = False

    def merge(self, other: IngestResult) -> None:
        """Append `other` into self (a later resync request replaces an earlier one)."""
        self.applied += other.applied
        self.ignored += other.ignored
        self.buffered += other.buffered
        self.deltas += other.deltas
        self.resync = other.resync or self.resync
        self.gap = self.gap or other.gap
        self.restart = self.restart or other.restart
