"""The `Engine` protocol every inference engine (vLLM, simulated) implements; its request and output types are
`kvmesh.core.generation`."""

from __future__ import annotations

from collections.abc import AsyncGenerator, Sequence
from typing import TYPE_CHECKING, Protocol, runtime_checkable

from kvmesh.core.generation import EngineOutput, EngineRequest, KvBlockData
from kvmesh.core.kvevents import BlockStored, KvEvent, LoadReport
from kvmesh.core.pull import KvPull, PullOutcome
from kvmesh.routing.types import TransferCosts

if TYPE_CHECKING:  # the tier types only annotate: kv-sync's region code stays out of every engine's import
    from kvmesh.kvplane.kvsync.tier import RegionReader, TierRegion


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

    def decode_token(self, token_id: int) -> str:
        """One token id's text with the engine's tokenizer (log-probabilities name their tokens by it)."""
        ...

    async def export_blocks(self, block_hashes: Sequence[int]) -> list[KvBlockData]:
        """Copy out cached blocks (kv-sync); unknown hashes are skipped."""
        ...

    async def import_blocks(self, blocks: Sequence[KvBlockData]) -> int:
        """Insert blocks into the prefix cache (kv-sync); returns how many were stored."""
        ...

    async def pull_prefix(self, req: EngineRequest, pull: KvPull) -> PullOutcome:
        """Arrange the pull of the prompt's leading blocks from a peer, before `generate`: the blocks obtained,
        and the pull `generate` loads them by (set it on the request's `kv_pull`). Never raises for a failed
        pull (those blocks are computed) and returns within the pull's deadline."""
        ...

    def served_tier(self) -> TierRegion | RegionReader | None:
        """The host tier region holding this engine's blocks, which the worker serves to its peers over
        kv-sync; None when there is none."""
        ...

    def transfer_costs(self) -> TransferCosts:
        """What tier loads and peer pulls cost this engine, for the router's pricing (`kvmesh.routing.dataplane`)."""
        ...
