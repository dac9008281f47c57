"""vLLM's KV-event wire format: the structs, one encoder, one decoder, translation to kvmesh events (pure).

Wire format (vLLM `ZmqEventPublisher`): frames `[topic, seq (8-byte big-endian), payload]`, payload the
msgpack of `KVEventBatch` = array `[ts, [events…], data_parallel_rank]`, each event a tagged map
(`{"type": "BlockStored", …}`), laid out as vLLM's `vllm/distributed/kv_events.py` lays them out. When vLLM
is importable its own msgspec classes may decode the payload; otherwise the equivalent schema below does
(unknown fields are ignored, so newer vLLM fields do not break it). Engine hashes may be bytes (sha256) or
ints; bytes become `int.from_bytes(b, "big") mod 2^64`, exactly vLLM's own int conversion. Only KV-cache
group `kv_group` is kept (other groups of hybrid models use other block sizes). The tenant of a chain is the
`cache_salt` in its first block's `extra_keys` (see `kvmesh.core.kvevents.cache_salt_of`); continuations carry
none and inherit it through their parent.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import msgspec

from kvmesh.core.kvevents import AllBlocksCleared, BlockRemoved, BlockStored, KvEvent, KvEventBatch, cache_salt_of

MASK64 = (1 << 64) - 1
ExternalBlockHash = bytes | int


class _Event(msgspec.Struct, tag=True, omit_defaults=True, gc=False):
    pass


class VllmBlockStored(_Event, tag="BlockStored"):
    """vLLM's `BlockStored` (fields without defaults are required by vLLM's own decoder too)."""

    block_hashes: list[ExternalBlockHash]
    parent_block_hash: ExternalBlockHash | None
    token_ids: list[int]
    block_size: int
    lora_id: int | None
    medium: str | None
    lora_name: str | None
    extra_keys: list[Any] | None = None
    group_idx: int | None = None


class VllmBlockRemoved(_Event, tag="BlockRemoved"):
    """vLLM's `BlockRemoved`."""

    block_hashes: list[ExternalBlockHash]
    medium: str | None
    group_idx: int | None = None


class VllmAllBlocksCleared(_Event, tag="AllBlocksCleared"):
    """vLLM's `AllBlocksCleared`."""


VllmEvent = VllmBlockStored | VllmBlockRemoved | VllmAllBlocksCleared


class VllmEventBatch(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    """vLLM's `KVEventBatch`: the payload of one frame."""

    ts: float
    events: list[VllmEvent]
    data_parallel_rank: int | None = None


_encoder = msgspec.msgpack.Encoder()


def make_decoder(prefer_vllm: bool = True) -> tuple[msgspec.msgpack.Decoder[Any], bool]:
    """(payload decoder, whether it uses vLLM's own classes): vLLM's when preferred and importable."""
    if prefer_vllm:
        try:
            from vllm.distributed.kv_events import KVEventBatch
        except Exception:
            pass
        else:
            return msgspec.msgpack.Decoder(type=KVEventBatch), True
    return msgspec.msgpack.Decoder(type=VllmEventBatch), False


def engine_hash(h: ExternalBlockHash) -> int:
    """vLLM external block hash → 64-bit int."""
    if isinstance(h, bytes | bytearray):
        return int.from_bytes(h, "big") & MASK64
    return int(h) & MASK64


def extra_keys_of(e: BlockStored) -> list[tuple[Any, ...] | None] | None:
    """Per-block `extra_keys` as vLLM publishes them (untagged): the LoRA name on every block, the cache salt
    (tenant) after it on the block that starts at token 0 (an event without a parent), None when empty."""
    n = len(e.block_hashes)
    base: tuple[Any, ...] = (e.lora_name,) if e.lora_name else ()
    keys: list[tuple[Any, ...] | None] = [base or None] * n
    if e.tenant and e.parent_block_hash is None and n:
        keys[0] = (*base, e.tenant)
    return keys if any(k is not None for k in keys) else None


def event_to_vllm(e: KvEvent, group_idx: int | None = None) -> VllmEvent:
    """Domain event → vLLM struct (hashes as 64-bit ints)."""
    if isinstance(e, BlockStored):
        parent = None if e.parent_block_hash is None else e.parent_block_hash & MASK64
        hashes: list[ExternalBlockHash] = [h & MASK64 for h in e.block_hashes]
        return VllmBlockStored(
            hashes, parent, list(e.token_ids), e.block_size, None, e.medium, e.lora_name, extra_keys_of(e), group_idx
        )
    if isinstance(e, BlockRemoved):
        return VllmBlockRemoved([h & MASK64 for h in e.block_hashes], e.medium, group_idx)
    return VllmAllBlocksCleared()


def event_from_vllm(e: Any, kv_group: int = 0) -> KvEvent | None:
    """A vLLM event (either class family) → domain event; None for another KV-cache group or an unknown kind."""
    group = getattr(e, "group_idx", None)
    if group is not None and group != kv_group:
        return None
    name = type(e).__name__.removeprefix("Vllm")
    if name == "BlockStored":
        parent = None if e.parent_block_hash is None else engine_hash(e.parent_block_hash)
        keys = getattr(e, "extra_keys", None)
        tenant = cache_salt_of(keys[0], e.lora_name) if keys and parent is None else None
        hashes = tuple(engine_hash(h) for h in e.block_hashes)
        return BlockStored(hashes, parent, tuple(e.token_ids), int(e.block_size), e.lora_name, e.medium, tenant)
    if name == "BlockRemoved":
        return BlockRemoved(tuple(engine_hash(h) for h in e.block_hashes), e.medium)
    if name == "AllBlocksCleared":
        return AllBlocksCleared()
    return None


def events_from_vllm(raw_events: Sequence[Any], kv_group: int = 0) -> tuple[KvEvent, ...]:
    """vLLM events → the domain events of KV-cache group `kv_group`, in order."""
    return tuple(ev for e in raw_events if (ev := event_from_vllm(e, kv_group)) is not None)


def encode_payload(b: KvEventBatch, group_idx: int | None = None) -> bytes:
    """msgpack payload of one batch in vLLM's `KVEventBatch` layout."""
    events = [event_to_vllm(e, group_idx) for e in b.events]
    return _encoder.encode(VllmEventBatch(b.timestamp, events, b.dp_rank))


def encode_seq(seq: int) -> bytes:
    """A frame's sequence number (8-byte big-endian, signed: vLLM's end-of-replay marker is -1)."""
    return seq.to_bytes(8, "big", signed=True)


def decode_seq(data: bytes) -> int:
    """Inverse of `encode_seq`."""
    return int.from_bytes(data, "big", signed=True)


END_SEQ = encode_seq(-1)


class VllmTranslator:
    """Frames of one vLLM publisher → `KvEventBatch`es of worker `worker_id` (KV-cache group `kv_group`).

    vLLM has no instance id: a sequence number lower than the last one seen on the live (SUB) socket
    means the server restarted (its counter starts at 0), so the instance id `<boot>-g<n>` moves on.
    """

    def __init__(self, worker_id: str, boot_id: str = "vllm", prefer_vllm: bool = True, kv_group: int = 0) -> None:
        self.worker_id = worker_id
        self.boot_id = boot_id
        self.kv_group = kv_group
        self.generation = 0
        self.last_live_seq = -1
        self.decoder, self.uses_vllm_classes = make_decoder(prefer_vllm)

    @property
    def instance_id(self) -> str:
        return f"{self.boot_id}-g{self.generation}"

    def decode(self, seq_bytes: bytes, payload: bytes, live: bool = True) -> KvEventBatch:
        """One frame → a batch (live frames can advance the generation; replayed ones cannot)."""
        seq = decode_seq(seq_bytes)
        if live:
            if seq < self.last_live_seq:
                self.generation += 1
            self.last_live_seq = seq
        b = self.decoder.decode(payload)
        events = events_from_vllm(b.events, self.kv_group)
        return KvEventBatch(self.worker_id, self.instance_id, seq, float(b.ts), events, int(b.data_parallel_rank or 0))
