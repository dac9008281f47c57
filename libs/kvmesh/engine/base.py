"""The `Engine` protocol every inference engine (vLLM, simulated) implements, and its domain types."""

from __future__ import annotations

from collections.abc import AsyncGenerator, Sequence
from dataclasses import dataclass, field
from typing import Protocol, runtime_checkable

from kvmesh.kvevents import BlockStored, KvEvent, LoadReport

DEFAULT_MAX_TOKENS_LIMIT = 8192

FINISH_STOP = "stop"
FINISH_LENGTH = "length"
FINISH_ABORT = "abort"
FINISH_PREFILL_ONLY = "prefill_only"


@dataclass(frozen=True, slots=True)
class SamplingParams:
    """Sampling parameters (vLLM semantics). `max_tokens=None` means up to the guard / context limit."""

    max_tokens: int | None = 16
    min_tokens: int = 0
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0  # 0 or -1: disabled
    seed: int | None = None
    stop_token_ids: tuple[int, ...] = ()
    stop: tuple[str, ...] = ()
    ignore_eos: bool = False
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0


@dataclass(frozen=True, slots=True)
class EngineRequest:
    """One generation request: token ids (preferred) or text, sampling, and flags.

    `prefill_only` computes and caches the prompt's KV blocks and finishes without sampling (warming).
    """

    request_id: str
    prompt_token_ids: tuple[int, ...] | None = None
    prompt: str | None = None
    sampling: SamplingParams = field(default_factory=SamplingParams)
    prefill_only: bool = False
    lora_name: str | None = None
    tenant: str | None = None  # part of the prefix-cache salt: tenants never share KV blocks


@dataclass(frozen=True, slots=True)
class Usage:
    """Token accounting of one request: `cached_tokens` of the prompt were served from the prefix cache."""

    prompt_tokens: int
    cached_tokens: int
    completion_tokens: int


@dataclass(frozen=True, slots=True)
class EngineOutput:
    """A streamed delta: new token ids (and text where the engine detokenises); `usage` on every output."""

    request_id: str
    token_ids: tuple[int, ...] = ()
    text: str = ""
    finished: bool = False
    finish_reason: str | None = None
    usage: Usage | None = None
    time_s: float | None = None  # engine-clock time it became available (sim: virtual now + step duration)


@dataclass(frozen=True, slots=True)
class KvBlockData:
    """One KV block moved by kv-sync: identity (engine hash, parent, tokens) and its bytes.

    `digest` is SHA-256 over `data`, checked on import; `nominal_bytes` is the size the block would have
    on the modelled hardware (the simulated engine ships a small stand-in payload).
    """

    block_hash: int
    parent_block_hash: int | None
    token_ids: tuple[int, ...]
    data: bytes
    digest: bytes
    nominal_bytes: int


@runtime_checkable
class Engine(Protocol):
    """An inference engine behind a worker. All methods are safe to call from one asyncio loop."""

    @property
    def block_size(self) -> int: ...

    @property
    def model_name(self) -> str: ...

    @property
    def max_model_len(self) -> int: ...

    async def start(self) -> None:
        """Load the model / start the loop; returns when ready to serve."""

    async def stop(self) -> None:
        """Abort everything in flight and release resources."""

    def generate(self, req: EngineRequest) -> AsyncGenerator[EngineOutput, None]:
        """Stream deltas; the last output has `finished=True`. Invalid input raises `InvalidArgument`
        before the first output; a full queue raises `ResourceExhausted`. Closing the iterator aborts."""
        ...

    async def abort(self, request_id: str) -> bool:
        """Abort a request; True when it was in flight."""
        ...

    def load_report(self) -> LoadReport:
        """Current load (running, waiting, KV usage, latencies, prefix hit rate)."""
        ...

    def kv_event_batches(self) -> AsyncGenerator[list[KvEvent], None]:
        """KV events in engine order, one list per engine step; every subscriber sees every batch."""
        ...

    async def dump_blocks(self) -> list[BlockStored]:
        """The whole current prefix cache as `BlockStored` events, parents before children (resync)."""
        ...

    async def tokenize(self, text: str) -> list[int]:
        """Text to token ids with the engine's tokenizer."""
        ...

    async def export_blocks(self, block_hashes: Sequence[int]) -> list[KvBlockData]:
        """Copy out cached blocks (kv-sync); unknown hashes are skipped."""
        ...

    async def import_blocks(self, blocks: Sequence[KvBlockData]) -> int:
        """Insert blocks into the prefix cache (kv-sync); returns how many were stored."""
        ...
