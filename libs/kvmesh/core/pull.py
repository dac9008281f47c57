"""A KV pull: a prompt's leading blocks fetched from a peer worker's tier instead of computed.

One type from the router's decision to the engine's KV connector (docs/architecture.md, "The pull path"):
the router's placement fills the peer's side (address, region, how many blocks, until when); the worker's
engine arranges it (`kvmesh.engine.base.Engine.pull_prefix`) and, where the blocks are loaded later by a KV
connector, hands on the same type with the lease it holds (`shm_name`, `digests`, `lease_until_ns`).
`kvmesh.wire.proto` converts it to and from the proto `KvPullHint`. Pure.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class CarriedLease:
    """A lease on the source's region taken by another process and carried with the pull (a replicated
    prefix's: its cache-manager leased the blocks next to the source worker), so the pulling worker only
    reads. `slots[i]` is `(slot, generation)` of `digests[i]`, None where the source does not hold it;
    `region_id` the leased region's identity; `expires_unix_ms` its end on the wall clock (a monotonic time
    means nothing on another host)."""

    digests: tuple[bytes, ...]
    slots: tuple[tuple[int, int] | None, ...]
    region_id: bytes
    expires_unix_ms: int

    def covering(self, digests: tuple[bytes, ...]) -> tuple[tuple[int, int] | None, ...] | None:
        """The slots of `digests` when they are a run of this lease's blocks (a pull may skip the leading
        ones its engine holds), else None: the lease is for other blocks."""
        if not digests or digests[0] not in self.digests:
            return None
        start = self.digests.index(digests[0])
        if self.digests[start : start + len(digests)] != digests:
            return None
        return self.slots[start : start + len(digests)]


@dataclass(frozen=True, slots=True)
class KvPull:
    """Pull the prompt's first `num_blocks` blocks (0: as many as `digests` names) from the peer at
    `source_address` (its KvSyncService), region `region` (shared memory `shm_name` when on the same host).

    `digests`, when given, are the receiving engine's own identities of those blocks (a mismatch means
    another model, salt or layout: never reuse). `lease_ms` is the lease to ask the source for (0: the
    worker's default), `expires_unix_ms` when the router's decision goes void (0: never), `timeout_ms` the
    transfer's deadline (0: the worker's). `lease_until_ns` is 0 until a lease is held on the blocks in
    `shm_name` (then its end on `time.monotonic_ns()`, the clock every user of a host's regions shares).
    `lease`: a lease on the source's blocks someone else took and handed on (`CarriedLease`; None: the
    worker leases itself).
    """

    source_address: str = ""
    region: str = ""
    num_blocks: int = 0
    source_worker_id: str = ""
    shm_name: str = ""
    digests: tuple[bytes, ...] = ()
    lease_ms: int = 0
    expires_unix_ms: int = 0
    timeout_ms: int = 0
    lease_until_ns: int = 0
    lease: CarriedLease | None = None

    def expired(self, now_unix_ms: float) -> bool:
        """Whether the router's decision is void by now (its blocks may have moved on)."""
        return bool(self.expires_unix_ms) and now_unix_ms >= self.expires_unix_ms


@dataclass(frozen=True, slots=True)
class PullOutcome:
    """What an engine made of a pull: `outcome` (a metric label: pulled, leased, remote, failed, ...), the
    leading blocks obtained, and `load`, the pull its `generate` loads them by (set on the request's
    `kv_pull`; None when nothing is left to do at generate, e.g. the blocks are in the engine's tier)."""

    outcome: str
    blocks: int = 0
    load: KvPull | None = None
