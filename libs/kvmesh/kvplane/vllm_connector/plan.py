"""The connector's scheduler-side decisions and the metadata it hands to the worker side (pure).

- `pull_params` / `parse_pull`: a leased pull (`kvmesh.core.pull.KvPull`) in a request's
  `kv_transfer_params["kvmesh_pull"]`, from the worker's event loop to the connector's scheduler side.
- `plan_loads`: which leading blocks beyond vLLM's own prefix hit can be loaded now, and from where
  (the worker's own tier first, else the hinted peer's region), from slot lookups already made.
- `RequestTracker`: per request, the block identities, vLLM block ids, how far its newly computed blocks
  were saved, and the state of an asynchronous load (in flight, failed); `ConnectorMetadata` carries one
  engine step's `LoadOp`s (synchronous: before the forward; asynchronous: in the background, the request
  waiting in vLLM's WAITING_FOR_REMOTE_KVS) and `SaveOp`s (published in the background).
- `lease_covers`: whether a peer block's copy may still start (a lease that ended fails the load closed).
- `BlockKey`: how vLLM's own KV events name a block (its hash, parent, tokens, extra keys, LoRA); it rides
  in the ops that put a block in the own tier, so the tier's events use vLLM's names (`events.py`).
Time enters as `now_ns`; nothing here touches shared memory, vLLM or torch.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

from kvmesh.core.pull import KvPull
from kvmesh.index.hashing import sha256_block_ids

PULL_KEY = "kvmesh_pull"
OWN = ""  # LoadOp.source of the worker's own tier
LEASE_MARGIN_NS = 50_000_000  # a lease ending within 50 ms is treated as expired: the copy would race it


class SlotLike(Protocol):
    """`kvmesh.kvplane.kvsync.tier.SlotRef`: a slot and the generation it had when it was located."""

    @property
    def slot(self) -> int: ...

    @property
    def generation(self) -> int: ...


def pull_params(pull: KvPull | None) -> dict[str, Any] | None:
    """`{PULL_KEY: {shm_name, lease_until_ns, digests (hex)}}` for a leased pull (JSON-safe: the params may
    cross to vLLM's engine-core process), or None when it names no digests."""
    if pull is None or not pull.digests:
        return None
    digests = [d.hex() for d in pull.digests]
    return {PULL_KEY: {"shm_name": pull.shm_name, "lease_until_ns": pull.lease_until_ns, "digests": digests}}


def parse_pull(params: Mapping[str, Any] | None) -> KvPull | None:
    """The leased pull in `kv_transfer_params` (no digests: the region offers any block), or None when absent
    or malformed (a bad pull is a cache miss, never an error: the request is computed as if there were none)."""
    if not params:
        return None
    raw = params.get(PULL_KEY)
    if not isinstance(raw, Mapping):
        return None
    name, until = raw.get("shm_name"), raw.get("lease_until_ns")
    if not isinstance(name, str) or not name or not isinstance(until, int) or isinstance(until, bool):
        return None
    digests = raw.get("digests", ())
    if not isinstance(digests, list | tuple):
        return None
    try:
        parsed = tuple(bytes.fromhex(d) if isinstance(d, str) else bytes(d) for d in digests)
    except (ValueError, TypeError):
        return None
    return KvPull(shm_name=name, num_blocks=len(parsed), digests=parsed, lease_until_ns=until)


def lease_usable(pull: KvPull, now_ns: int) -> bool:
    """Whether the pull's lease still covers a copy started now."""
    return pull.lease_until_ns > now_ns + LEASE_MARGIN_NS


def offered(pull: KvPull, want: Sequence[bytes], refs: Sequence[SlotLike | None]) -> list[SlotLike | None]:
    """`refs` (the peer region's lookups of `want`) less the blocks the pull does not offer (no digests: all)."""
    if not pull.digests:
        return list(refs)
    offers = set(pull.digests)
    return [r if d in offers else None for r, d in zip(refs, want, strict=True)]


@dataclass(frozen=True)
class BlockSource:
    """Where block `index` of a request's prompt is loaded from; a peer's block only while its lease lasts
    (`lease_until_ns`, CLOCK_MONOTONIC; 0 for the own tier, which no one else evicts from)."""

    index: int
    source: str  # OWN or a peer's shm name
    slot: int
    generation: int
    lease_until_ns: int = 0


def loadable_blocks(num_tokens: int, block_size: int) -> int:
    """Full blocks of a request's tokens that may be loaded: vLLM must compute at least the last token."""
    return max(num_tokens - 1, 0) // block_size


def plan_loads(
    start: int,
    own: Sequence[SlotLike | None],
    peer: Sequence[SlotLike | None],
    peer_name: str,
    peer_lease_until_ns: int = 0,
) -> list[BlockSource]:
    """The leading run of blocks `start, start+1, ...` held by the own tier (preferred) or the peer.

    `own[i]` / `peer[i]` are the slot lookups of block `start + i` (a shorter `peer` means the peer offers
    nothing further); the run stops at the first block neither holds. A peer's block carries the pull's
    lease, which the copy must not outlast.
    """
    out: list[BlockSource] = []
    for i, ref in enumerate(own):
        src, until = OWN, 0
        if ref is None:
            ref = peer[i] if i < len(peer) else None
            src, until = peer_name, peer_lease_until_ns
        if ref is None:
            break
        out.append(BlockSource(start + i, src, ref.slot, ref.generation, until))
    return out


def lease_covers(lease_until_ns: int, now_ns: int) -> bool:
    """Whether a block copy starting at `now_ns` is still covered by its lease (0: the own tier, no lease).

    Past the lease the owner may reuse the slot: the copy is not started, and that block and all after it
    are reported failed (vLLM recomputes them). A copy that started in time and finds the slot unchanged
    after it (the tier's seqlock check) and its CRC32C right is a verified block, whenever the lease ends.
    """
    return lease_until_ns == 0 or now_ns < lease_until_ns


@dataclass(frozen=True)
class BlockKey:
    """Block `index` of a request as vLLM's KV events name it: its hash and its parent's (vLLM's external
    form, bytes or int), its token ids, its untagged `extra_keys` entry (LoRA name, cache salt, ...) and
    its LoRA adapter (name, id)."""

    block_hash: Any
    parent_hash: Any
    token_ids: tuple[int, ...]
    extra_keys: tuple[Any, ...] | None = None
    lora_name: str | None = None
    lora_id: int | None = None


@dataclass(frozen=True)
class LoadOp:
    """Copy the block `digest` (block `index` of the request) from `source` slot (`slot`, `generation`)
    into vLLM block `block_id`, started before `lease_until_ns` when from a peer (0: the own tier, no
    lease); `key` names it in the tier's events when it is kept in the own tier."""

    req_id: str
    block_id: int
    digest: bytes
    source: str
    slot: int
    generation: int
    index: int = -1
    key: BlockKey | None = None
    lease_until_ns: int = 0


@dataclass(frozen=True)
class SaveOp:
    """Store vLLM block `block_id` (just computed; block `index` of request `req_id`) in the own tier under
    `digest`; `key` names it in the tier's events (None: no events)."""

    block_id: int
    digest: bytes
    index: int = -1
    key: BlockKey | None = None
    req_id: str = ""


@dataclass
class ConnectorMetadata:
    """One step's work for the worker side (picklable: it may cross to a worker process): `loads` copied
    before the step's forward, `async_loads` in the background (their requests wait, unscheduled, until
    `get_finished` reports them), `saves` of the blocks the step computes, and `preempted`: requests vLLM
    took blocks from this step (a save of theirs still pending must finish before the blocks are reused)."""

    loads: list[LoadOp] = field(default_factory=list)
    async_loads: list[LoadOp] = field(default_factory=list)
    saves: list[SaveOp] = field(default_factory=list)
    preempted: list[str] = field(default_factory=list)


@dataclass
class RequestTracker:
    """What the scheduler side knows of one request: its tokens (a live view: it grows as the request
    decodes) and identity salt, the identities of its full blocks so far, the vLLM block ids allocated to it,
    the loads planned for it, the first block not yet saved and whether any save was issued (its blocks
    then stay allocated until the worker side reports the saves done), and its asynchronous load: the vLLM
    blocks being loaded, and whether a load of it failed (it is never claimed again: vLLM looks a request
    whose load failed up again, and a block that failed once would fail again)."""

    tokens: Sequence[int]
    salt: bytes
    block_size: int
    digests: list[bytes] = field(default_factory=list)
    block_ids: list[int] = field(default_factory=list)
    planned: list[BlockSource] = field(default_factory=list)
    saved_upto: int = -1  # -1: not scheduled yet
    req_id: str = ""
    saves_issued: bool = False
    loading: set[int] = field(default_factory=set)
    load_failed: bool = False

    def digests_upto(self, n: int) -> list[bytes]:
        """The identities of the first `n` blocks, or of as many as are full of known tokens."""
        bs = self.block_size
        n = min(n, len(self.tokens) // bs)
        if n > len(self.digests):
            self.digests = sha256_block_ids(list(self.tokens[: n * bs]), bs, self.salt)
        return self.digests[:n]

    def loads(self, req_id: str) -> list[LoadOp]:
        """The planned loads as ops on the allocated vLLM blocks (consumed: a plan is executed once)."""
        ops = [
            LoadOp(
                req_id,
                self.block_ids[s.index],
                self.digests[s.index],
                s.source,
                s.slot,
                s.generation,
                s.index,
                lease_until_ns=s.lease_until_ns,
            )
            for s in self.planned
            if s.index < len(self.block_ids)
        ]
        self.planned = []
        return ops

    def load_done(self, failed_block_ids: set[int]) -> None:
        """The asynchronous load ended; it failed if any of its blocks is in `failed_block_ids`."""
        if self.loading & failed_block_ids:
            self.load_failed = True
        self.loading = set()

    def step(self, num_computed: int, num_scheduled: int) -> list[SaveOp]:
        """Saves for the full blocks (prompt or generated) whose KV this step completes.

        `num_computed` is the tokens computed before the step (vLLM's prefix hit plus the loaded blocks on
        the first step); blocks below it were computed elsewhere and are not saved again, except after a load
        failure made vLLM recompute them (`num_computed` then drops below `saved_upto`). A block whose last
        tokens are not known here yet (asynchronous scheduling) is saved by a later step.
        """
        first = num_computed // self.block_size
        if self.saved_upto < 0 or first < self.saved_upto:
            self.saved_upto = first
        want = min((num_computed + num_scheduled) // self.block_size, len(self.block_ids))
        done = len(self.digests_upto(want))
        ops = [SaveOp(self.block_ids[i], self.digests[i], i, req_id=self.req_id) for i in range(self.saved_upto, done)]
        self.saved_upto = max(self.saved_upto, done)
        self.saves_issued |= bool(ops)
        return ops
