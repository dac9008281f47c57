"""Decoding of a stock vLLM server's KV-event frames into kvmesh domain events (pure).

Wire format (vLLM `ZmqEventPublisher`): frames `[topic, seq (8-byte big-endian), payload]`, payload the
msgpack of `KVEventBatch` = array `[ts, [events…], data_parallel_rank]`, each event a tagged map
(`{"type": "BlockStored", …}`). When vLLM is importable its own msgspec classes decode the payload
(`vllm.distributed.kv_events.KVEventBatch`); otherwise an equivalent schema below does (unknown fields
are ignored, so newer vLLM fields do not break it). Engine hashes may be bytes (sha256) or ints; bytes
become `int.from_bytes(b, "big") mod 2^64`, exactly vLLM's own int conversion. Only KV-cache group
`kv_group` is indexed (other groups of hybrid models use other block sizes). The tenant of a chain is the
`cache_salt` in its first block's `extra_keys` (see `kvmesh.kvevents.cache_salt_of`); continuations carry
none and inherit it through their parent's index hash.
"""

from __future__ import annotations

from typing import Any

import msgspec

from kvmesh.kvevents import AllBlocksCleared, BlockRemoved, BlockStored, KvEvent, KvEventBatch, cache_salt_of

MASK64 = (1 << 64) - 1


class _Ev(msgspec.Struct, tag=True, omit_defaults=True, gc=False):
    pass


class _BlockStored(_Ev, tag="BlockStored"):
    block_hashes: list[bytes | int] = []
    parent_block_hash: bytes | int | None = None
    token_ids: list[int] = []
    block_size: int = 0
    lora_id: int | None = None
    medium: str | None = None
    lora_name: str | None = None
    extra_keys: list[Any] | None = None
    group_idx: int | None = None


class _BlockRemoved(_Ev, tag="BlockRemoved"):
    block_hashes: list[bytes | int] = []
    medium: str | None = None
    group_idx: int | None = None


class _AllBlocksCleared(_Ev, tag="AllBlocksCleared"):
    pass


class _Batch(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    ts: float
    events: list[_BlockStored | _BlockRemoved | _AllBlocksCleared]
    data_parallel_rank: int | None = None


def _vllm_decoder() -> msgspec.msgpack.Decoder[Any] | None:
    try:
        from vllm.distributed.kv_events import KVEventBatch
    except Exception:
        return None
    return msgspec.msgpack.Decoder(type=KVEventBatch)


def make_decoder(prefer_vllm: bool = True) -> tuple[msgspec.msgpack.Decoder[Any], bool]:
    """(decoder, uses vLLM's classes)."""
    if prefer_vllm:
        dec = _vllm_decoder()
        if dec is not None:
            return dec, True
    return msgspec.msgpack.Decoder(type=_Batch), False


def engine_hash(h: bytes | int) -> int:
    """vLLM external block hash → 64-bit int."""
    if isinstance(h, bytes | bytearray):
        return int.from_bytes(h, "big") & MASK64
    return int(h) & MASK64


def to_domain_events(raw_events: list[Any], kv_group: int = 0) -> tuple[KvEvent, ...]:
    """vLLM event objects (either class family) → domain events of KV-cache group `kv_group`."""
    out: list[KvEvent] = []
    for e in raw_events:
        name = type(e).__name__.lstrip("_")
        group = getattr(e, "group_idx", None)
        if group is not None and group != kv_group:
            continue
        if name == "BlockStored":
            parent = None if e.parent_block_hash is None else engine_hash(e.parent_block_hash)
            keys = getattr(e, "extra_keys", None)
            tenant = cache_salt_of(keys[0], e.lora_name) if keys and parent is None else None
            out.append(
                BlockStored(
                    tuple(engine_hash(h) for h in e.block_hashes),
                    parent,
                    tuple(e.token_ids),
                    int(e.block_size),
                    e.lora_name,
                    e.medium,
                    tenant,
                )
            )
        elif name == "BlockRemoved":
            out.append(BlockRemoved(tuple(engine_hash(h) for h in e.block_hashes), e.medium))
        elif name == "AllBlocksCleared":
            out.append(AllBlocksCleared())
    return tuple(out)


class VllmTranslator:
    """Frames of one vLLM publisher → `KvEventBatch`es of worker `worker_id`.

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
        seq = int.from_bytes(seq_bytes, "big")
        if live:
            if seq < self.last_live_seq:
                self.generation += 1
            self.last_live_seq = seq
        b = self.decoder.decode(payload)
        return KvEventBatch(
            self.worker_id,
            self.instance_id,
            seq,
            float(b.ts),
            to_domain_events(b.events, self.kv_group),
            int(b.data_parallel_rank or 0),
        )
