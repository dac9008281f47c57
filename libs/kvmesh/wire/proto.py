"""Every proto <-> domain conversion (pure): KV events and batches, dumps, index deltas, load reports,
generate requests and outputs. Pairs are named `x_to_proto` / `x_from_proto`; the one-way ones are those
whose other side works on the proto itself (the router splices request bytes, replays index deltas and
reads worker outputs straight from the messages)."""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator, Sequence

from kvmesh.core.generation import (
    EngineOutput,
    EngineRequest,
    PositionLogprobs,
    SamplingParams,
    StructuredOutput,
    TokenLogprob,
)
from kvmesh.core.handoff import KvHandoff, WorkerRole
from kvmesh.core.kvevents import AllBlocksCleared, BlockRemoved, BlockStored, KvEvent, KvEventBatch, LoadReport
from kvmesh.core.pull import CarriedLease, KvPull
from kvmesh.index.types import Cleared, IndexDelta, Media, Removed, Stored
from kvmesh.v1 import cache_manager_pb2, common_pb2, kvsync_pb2, worker_pb2

FINISH = {
    "stop": common_pb2.FINISH_REASON_STOP,
    "length": common_pb2.FINISH_REASON_LENGTH,
    "abort": common_pb2.FINISH_REASON_ABORT,
    "prefill_only": common_pb2.FINISH_REASON_LENGTH,
}
MASK64 = (1 << 64) - 1


def sampling_from_proto(p: common_pb2.SamplingParams) -> SamplingParams:
    """proto3 zero values mean "unset": top_p 0 -> 1, repetition_penalty 0 -> 1, max_tokens 0 -> the worker's
    guard."""
    return SamplingParams(
        max_tokens=p.max_tokens or None,
        min_tokens=p.min_tokens,
        temperature=p.temperature,
        top_p=p.top_p or 1.0,
        top_k=p.top_k,
        seed=p.seed if p.HasField("seed") else None,
        stop_token_ids=tuple(p.stop_token_ids),
        stop=tuple(p.stop),
        ignore_eos=p.ignore_eos,
        presence_penalty=p.presence_penalty,
        frequency_penalty=p.frequency_penalty,
        repetition_penalty=p.repetition_penalty or 1.0,
        n=p.n or 1,
        logprobs=p.logprobs if p.HasField("logprobs") else None,
        prompt_logprobs=p.prompt_logprobs if p.HasField("prompt_logprobs") else None,
        min_p=p.min_p,
        logit_bias=tuple(sorted(p.logit_bias.items())),
        bad_words=tuple(p.bad_words),
        allowed_token_ids=tuple(p.allowed_token_ids),
        include_stop_str_in_output=p.include_stop_str_in_output,
        skip_special_tokens=p.skip_special_tokens if p.HasField("skip_special_tokens") else True,
        structured_output=structured_from_proto(p.structured_output) if p.HasField("structured_output") else None,
        priority=p.priority,
    )


def structured_from_proto(s: common_pb2.StructuredOutput) -> StructuredOutput | None:
    """The wire's constraint → the domain's (None when no constraint is set)."""
    kind = s.WhichOneof("constraint")
    if kind is None:
        return None
    if kind == "choice":
        return StructuredOutput(choice=tuple(s.choice.choices))
    if kind == "json_object":
        return StructuredOutput(json_object=s.json_object)
    return StructuredOutput(**{kind: getattr(s, kind)})


def structured_to_proto(s: StructuredOutput) -> common_pb2.StructuredOutput:
    """The domain's constraint → the wire's."""
    kind = s.kind
    if kind == "choice":
        return common_pb2.StructuredOutput(choice=common_pb2.StructuredOutputChoices(choices=s.choice))
    return common_pb2.StructuredOutput(**{kind: getattr(s, kind)})


def sampling_to_proto(sp: SamplingParams) -> common_pb2.SamplingParams:
    """The engine's sampling -> the wire's (max_tokens None = 0, the receiver's default)."""
    out = common_pb2.SamplingParams(
        temperature=sp.temperature,
        top_p=sp.top_p,
        top_k=sp.top_k,
        max_tokens=sp.max_tokens or 0,
        stop=sp.stop,
        stop_token_ids=sp.stop_token_ids,
        ignore_eos=sp.ignore_eos,
        min_tokens=sp.min_tokens,
        presence_penalty=sp.presence_penalty,
        frequency_penalty=sp.frequency_penalty,
        repetition_penalty=sp.repetition_penalty,
        n=sp.n,
        min_p=sp.min_p,
        logit_bias=dict(sp.logit_bias),
        bad_words=sp.bad_words,
        allowed_token_ids=sp.allowed_token_ids,
        include_stop_str_in_output=sp.include_stop_str_in_output,
        priority=sp.priority,
    )
    if sp.seed is not None:
        out.seed = sp.seed
    if sp.logprobs is not None:
        out.logprobs = sp.logprobs
    if sp.prompt_logprobs is not None:
        out.prompt_logprobs = sp.prompt_logprobs
    if not sp.skip_special_tokens:
        out.skip_special_tokens = False
    if sp.structured_output is not None:
        out.structured_output.CopyFrom(structured_to_proto(sp.structured_output))
    return out


def logprobs_to_proto(entries: Sequence[PositionLogprobs | None]) -> list[common_pb2.PositionLogprobs]:
    """Per-position log-probabilities → the wire's (a position without any, the prompt's first, is empty)."""
    return [
        common_pb2.PositionLogprobs()
        if e is None
        else common_pb2.PositionLogprobs(token=_logprob_to_proto(e.token), top=[_logprob_to_proto(x) for x in e.top])
        for e in entries
    ]


def logprobs_from_proto(entries: Sequence[common_pb2.PositionLogprobs]) -> tuple[PositionLogprobs | None, ...]:
    """The wire's per-position log-probabilities → the domain's (an empty entry is None)."""
    return tuple(
        PositionLogprobs(_logprob_from_proto(e.token), tuple(_logprob_from_proto(x) for x in e.top))
        if e.HasField("token")
        else None
        for e in entries
    )


def _logprob_to_proto(x: TokenLogprob) -> common_pb2.TokenLogprob:
    return common_pb2.TokenLogprob(token_id=x.token_id, logprob=x.logprob, rank=x.rank)


def _logprob_from_proto(x: common_pb2.TokenLogprob) -> TokenLogprob:
    return TokenLogprob(x.token_id, x.logprob, x.rank)


def request_from_proto(r: worker_pb2.GenerateRequest) -> EngineRequest:
    """Worker `GenerateRequest` → the engine's request."""
    kind = r.WhichOneof("prompt")
    return EngineRequest(
        request_id=r.request_id,
        prompt_token_ids=tuple(r.token_ids.ids) if kind == "token_ids" else None,
        prompt=r.text if kind == "text" else None,
        sampling=sampling_from_proto(r.sampling),
        prefill_only=r.prefill_only,
        lora_name=r.lora_name or None,
        tenant=r.tenant or None,
        resumed_output_tokens=r.resumed_output_tokens,
        hand_off_ms=r.hand_off_ms,
        handoff=handoff_from_proto(r.handoff) if r.HasField("handoff") else None,
    )


_ROLES = {
    WorkerRole.BOTH: worker_pb2.WORKER_ROLE_BOTH,
    WorkerRole.PREFILL: worker_pb2.WORKER_ROLE_PREFILL,
    WorkerRole.DECODE: worker_pb2.WORKER_ROLE_DECODE,
}
_ROLES_BACK = {v: k for k, v in _ROLES.items()}


def role_to_proto(r: WorkerRole) -> worker_pb2.WorkerRole.ValueType:
    return _ROLES[r]


def role_from_proto(v: worker_pb2.WorkerRole.ValueType) -> WorkerRole:
    """A GetInfo's role; unset (an older worker) is `both`."""
    return _ROLES_BACK.get(v, WorkerRole.BOTH)


def handoff_to_proto(h: KvHandoff) -> worker_pb2.KvHandoff:
    """A handoff as it travels: a prefill half's last response, a decode half's request."""
    msg = worker_pb2.KvHandoff(
        engine_params_json=h.engine_params_json,
        num_blocks=h.num_blocks,
        held_until_unix_ms=h.held_until_unix_ms,
        source_worker_id=h.source_worker_id,
        cached_tokens=h.cached_tokens,
    )
    if h.pull is not None:
        msg.pull.CopyFrom(pull_to_proto(h.pull))
    return msg


def handoff_from_proto(h: worker_pb2.KvHandoff) -> KvHandoff:
    return KvHandoff(
        num_blocks=h.num_blocks,
        held_until_unix_ms=h.held_until_unix_ms,
        source_worker_id=h.source_worker_id,
        engine_params_json=h.engine_params_json,
        pull=pull_from_proto(h.pull) if h.HasField("pull") else None,
        cached_tokens=h.cached_tokens,
    )


def pull_to_proto(p: KvPull) -> worker_pb2.KvPullHint:
    """A pull as the router sends it to a worker (a lease held on this host, `lease_until_ns`, never travels;
    a carried one, `lease`, does)."""
    return worker_pb2.KvPullHint(
        source_worker_id=p.source_worker_id,
        source_address=p.source_address,
        region=p.region,
        region_shm_name=p.shm_name,
        num_blocks=p.num_blocks,
        block_digests=list(p.digests),
        lease_ms=p.lease_ms,
        expires_unix_ms=p.expires_unix_ms,
        timeout_ms=p.timeout_ms,
        lease=held_lease_to_proto(p.lease) if p.lease is not None else None,
    )


def pull_from_proto(h: worker_pb2.KvPullHint) -> KvPull:
    """A worker's `kv_pull` → the domain pull its engine arranges."""
    return KvPull(
        source_address=h.source_address,
        region=h.region,
        num_blocks=h.num_blocks,
        source_worker_id=h.source_worker_id,
        shm_name=h.region_shm_name,
        digests=tuple(h.block_digests),
        lease_ms=h.lease_ms,
        expires_unix_ms=h.expires_unix_ms,
        timeout_ms=h.timeout_ms,
        lease=held_lease_from_proto(h.lease) if h.HasField("lease") else None,
    )


def held_lease_to_proto(lease: CarriedLease) -> kvsync_pb2.HeldLease:
    return kvsync_pb2.HeldLease(
        digests=list(lease.digests),
        blocks=[
            kvsync_pb2.LeasedBlock(found=True, slot=s[0], generation=s[1])
            if s is not None
            else kvsync_pb2.LeasedBlock()
            for s in lease.slots
        ],
        region_id=lease.region_id,
        expires_unix_ms=lease.expires_unix_ms,
    )


def held_lease_from_proto(h: kvsync_pb2.HeldLease) -> CarriedLease | None:
    """The carried lease, or None when it is malformed (not one block per digest): the worker leases itself."""
    if len(h.blocks) != len(h.digests):
        return None
    return CarriedLease(
        digests=tuple(h.digests),
        slots=tuple((b.slot, b.generation) if b.found else None for b in h.blocks),
        region_id=h.region_id,
        expires_unix_ms=h.expires_unix_ms,
    )


def output_to_proto(o: EngineOutput, worker_id: str, detokenize: bool) -> worker_pb2.GenerateResponse:
    """One engine output → a worker `GenerateResponse` (usage and finish reason on the last one)."""
    msg = worker_pb2.GenerateResponse(token_ids=list(o.token_ids), worker_id=worker_id, index=o.index)
    if o.logprobs:
        msg.logprobs.extend(logprobs_to_proto(o.logprobs))
    if o.prompt_logprobs:
        msg.prompt_logprobs.extend(logprobs_to_proto(o.prompt_logprobs))
    if detokenize:
        msg.text = o.text
    if o.handoff is not None:
        msg.handoff.CopyFrom(handoff_to_proto(o.handoff))
    if o.finished:
        msg.finish_reason = FINISH.get(o.finish_reason or "", common_pb2.FINISH_REASON_STOP)
        if o.usage is not None:
            msg.usage.CopyFrom(
                common_pb2.Usage(
                    prompt_tokens=o.usage.prompt_tokens,
                    cached_tokens=o.usage.cached_tokens,
                    completion_tokens=o.usage.completion_tokens,
                )
            )
    return msg


# every field of the domain report but `extra` (local only) travels, under the same name
_LOAD_FIELDS = tuple(f.name for f in dataclasses.fields(LoadReport) if f.name != "extra")


def load_to_proto(r: LoadReport) -> common_pb2.LoadReport:
    """Domain load report → proto (`extra` stays local)."""
    return common_pb2.LoadReport(**{name: getattr(r, name) for name in _LOAD_FIELDS})


def load_from_proto(r: common_pb2.LoadReport) -> LoadReport:
    """Proto load report → domain `LoadReport`."""
    return LoadReport(**{name: getattr(r, name) for name in _LOAD_FIELDS})


def event_to_proto(e: KvEvent) -> common_pb2.KvEvent:
    """Domain event → proto (engine hashes taken modulo 2^64)."""
    if isinstance(e, BlockStored):
        bs = common_pb2.BlockStored(
            block_hashes=[h & MASK64 for h in e.block_hashes],
            token_ids=list(e.token_ids),
            block_size=e.block_size,
            lora_name=e.lora_name or "",
            medium=e.medium or "",
            tenant=e.tenant or "",
        )
        if e.parent_block_hash is not None:
            bs.parent_block_hash = e.parent_block_hash & MASK64
        return common_pb2.KvEvent(block_stored=bs)
    if isinstance(e, BlockRemoved):
        return common_pb2.KvEvent(
            block_removed=common_pb2.BlockRemoved(
                block_hashes=[h & MASK64 for h in e.block_hashes], medium=e.medium or ""
            )
        )
    assert isinstance(e, AllBlocksCleared)
    return common_pb2.KvEvent(all_blocks_cleared=common_pb2.AllBlocksCleared())


def event_from_proto(e: common_pb2.KvEvent) -> KvEvent | None:
    """Proto event → domain (None for an empty oneof)."""
    which = e.WhichOneof("event")
    if which == "block_stored":
        s = e.block_stored
        parent = s.parent_block_hash if s.HasField("parent_block_hash") else None
        return BlockStored(
            tuple(s.block_hashes),
            parent,
            tuple(s.token_ids),
            s.block_size,
            s.lora_name or None,
            s.medium or None,
            s.tenant or None,
        )
    if which == "block_removed":
        return BlockRemoved(tuple(e.block_removed.block_hashes), e.block_removed.medium or None)
    if which == "all_blocks_cleared":
        return AllBlocksCleared()
    return None


def events_from_proto(b: common_pb2.KvEventBatch) -> tuple[KvEvent, ...]:
    """The domain events of a proto batch (empty oneofs dropped)."""
    return tuple(ev for e in b.events if (ev := event_from_proto(e)) is not None)


def batch_to_proto(b: KvEventBatch) -> common_pb2.KvEventBatch:
    """Domain batch → proto."""
    return common_pb2.KvEventBatch(
        worker_id=b.worker_id,
        instance_id=b.instance_id,
        sequence=b.sequence,
        timestamp=b.timestamp,
        events=[event_to_proto(e) for e in b.events],
        dp_rank=b.dp_rank,
    )


def batch_from_proto(b: common_pb2.KvEventBatch, worker_id: str = "", instance_id: str = "") -> KvEventBatch:
    """Proto batch → domain; the stream's hello fills a missing worker/instance id."""
    return KvEventBatch(
        b.worker_id or worker_id, b.instance_id or instance_id, b.sequence, b.timestamp, events_from_proto(b), b.dp_rank
    )


def dump_messages(
    worker_id: str, instance_id: str, seq: int, blocks: Sequence[BlockStored], timestamp: float, chunk: int = 512
) -> Iterator[tuple[common_pb2.KvStreamKind.ValueType, common_pb2.KvEventBatch]]:
    """(kind, batch) for a full dump: DUMP_BEGIN (first chunk), DUMP_CHUNK..., DUMP_END (empty); all carry
    sequence = `seq`, the last live batch the dump includes."""
    chunks = [blocks[i : i + chunk] for i in range(0, len(blocks), chunk)] or [[]]
    for i, part in enumerate(chunks):
        kind = common_pb2.KV_STREAM_KIND_DUMP_BEGIN if i == 0 else common_pb2.KV_STREAM_KIND_DUMP_CHUNK
        yield (
            kind,
            common_pb2.KvEventBatch(
                worker_id=worker_id,
                instance_id=instance_id,
                sequence=seq,
                timestamp=timestamp,
                events=[event_to_proto(e) for e in part],
            ),
        )
    yield (
        common_pb2.KV_STREAM_KIND_DUMP_END,
        common_pb2.KvEventBatch(worker_id=worker_id, instance_id=instance_id, sequence=seq, timestamp=timestamp),
    )


def delta_to_proto(d: IndexDelta) -> cache_manager_pb2.IndexDelta:
    """Domain index delta → proto."""
    if isinstance(d, Stored):
        msg = cache_manager_pb2.IndexDelta(worker_id=d.worker, stored=list(d.hashes))
        if d.parent is not None:
            msg.parent = d.parent
        return msg
    if isinstance(d, Removed):
        return cache_manager_pb2.IndexDelta(worker_id=d.worker, removed=list(d.hashes))
    if isinstance(d, Media):
        return cache_manager_pb2.IndexDelta(worker_id=d.worker, tier_only=list(d.tier_only), on_gpu=list(d.on_gpu))
    assert isinstance(d, Cleared)
    return cache_manager_pb2.IndexDelta(worker_id=d.worker, cleared=True)
