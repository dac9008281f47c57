"""What a trace allows any fleet, independent of routing (pure: no simulation, no clock).

* **Unservable requests** (:func:`unservable_reason`, :func:`servable_trace`): a request the simulated engine
  refuses on its own, whatever the load and wherever it is routed — prompt + output beyond the model's
  context (``max_model_len``), an output above the engine's ``max_tokens`` limit, a prompt larger than one
  worker's KV admission limit, an empty prompt. They are the trace's, not the policy's: the evaluation
  removes them (and the closed-loop follow-ups that would wait on them) before any policy runs and counts
  them apart, with the reason.
* **Idle, infinite-cache TTFT** (:func:`ideal_cached_tokens`, :func:`ideal_ttft_s`): the TTFT a request would
  have alone on an idle engine whose cache never evicts. Its cached part is the longest prefix of full
  blocks seen in any earlier request of the trace (hashes are salted, so only the same salt hits), capped
  as the engine caps a hit (the last prompt token is always computed); the rest is prefilled in chunks at
  the perf model's price. No policy, queue or data plane can do better, so
  ``ttft_excess = TTFT − ideal TTFT ≥ 0``: it counts queueing and lost cache.
"""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field, replace

import numpy as np

from kvmesh.core.errors import InvalidArgument
from kvmesh.core.generation import SamplingParams
from kvmesh.core.sampling import resolve_max_tokens, validate_sampling
from kvmesh.engine.sim.core import SimConfig
from kvmesh.engine.sim.perf import PerfModel, chunked_prefill_time
from kvmesh.fleet.trace import Trace, TraceRequest

INDICES_SHOWN = 50  # trace indices of unservable requests listed in results.json (the first ones)
# InvalidArgument field of the engine's own checks -> reason reported for the request
_REASON_OF_FIELD = {"prompt": "context", "max_tokens": "context"}


def unservable_reason(input_len: int, output_len: int, engine: SimConfig) -> str | None:
    """Why no worker built from ``engine`` can ever accept this request, or None if one can.

    Reasons: ``"empty_prompt"``, ``"max_tokens_limit"`` (output above the engine's limit), ``"context"``
    (prompt + output > ``max_model_len``), ``"kv_pool"`` (the prompt alone exceeds the KV admission limit of
    an empty worker). The first two checks are the engine's own functions (``kvmesh.core.sampling``); the
    last repeats ``SimEngineCore.add_request``'s rule, and a test checks that the simulator agrees.
    """
    if input_len <= 0:
        return "empty_prompt"
    sampling = SamplingParams(max_tokens=output_len, ignore_eos=True)
    try:
        validate_sampling(sampling, engine.max_tokens_limit)
    except InvalidArgument:
        return "max_tokens_limit"
    try:
        resolve_max_tokens(sampling, input_len, engine.max_model_len, engine.max_tokens_limit)
    except InvalidArgument as e:
        return _REASON_OF_FIELD.get(e.field, e.field)
    need = math.ceil((input_len + 1) / engine.block_size)
    if need > engine.kv_admission_threshold * engine.resolved_num_blocks():
        return "kv_pool"
    return None


@dataclass(slots=True)
class Unservable:
    """The requests :func:`servable_trace` removed: original indices, reasons, dropped follow-ups."""

    indices: list[int] = field(default_factory=list)
    reasons: Counter[str] = field(default_factory=Counter)
    followups: int = 0
    of_requests: int = 0

    def as_dict(self) -> dict[str, object]:
        """The ``trace_unservable`` entry of ``results.json``."""
        return {
            "count": len(self.indices),
            "of_requests": self.of_requests,
            "reasons": dict(sorted(self.reasons.items())),
            "dropped_followups": self.followups,
            "indices": self.indices[:INDICES_SHOWN],
        }


def servable_trace(trace: Trace, engine: SimConfig) -> tuple[Trace, Unservable]:
    """``trace`` without its unservable requests and the follow-ups chained on them (the simulator never
    sends a follow-up of a request that never completes), re-indexed from 0 with ``follows`` remapped."""
    gone = Unservable(of_requests=len(trace))
    drop: set[int] = set()
    for r in trace.requests:
        if r.follows is not None and r.follows in drop:
            drop.add(r.index)
            gone.followups += 1
            continue
        why = unservable_reason(r.input_len, r.output_len, engine)
        if why is not None:
            drop.add(r.index)
            gone.indices.append(r.index)
            gone.reasons[why] += 1
    if not drop:
        return trace, gone
    new_index: dict[int, int] = {}
    reqs: list[TraceRequest] = []
    for r in trace.requests:
        if r.index in drop:
            continue
        new_index[r.index] = len(reqs)
        follows = None if r.follows is None else new_index[r.follows]
        reqs.append(replace(r, index=len(reqs), follows=follows))
    meta = {**trace.meta, "unservable_removed": len(drop)}
    return Trace(trace.name, reqs, meta), gone


def ideal_cached_tokens(prompts: Iterable[tuple[int, np.ndarray]], block_size: int) -> list[int]:
    """Per prompt ``(tokens, full-block hashes)`` in arrival order: the tokens an infinite cache holds for it
    — the leading run of its blocks already seen, at most ``(tokens − 1) // block_size`` blocks (the engine
    always computes the last prompt token) — after which all its full blocks are seen."""
    seen: set[int] = set()
    out: list[int] = []
    for n_tokens, hashes in prompts:
        hs = hashes.tolist()
        k = 0
        cap = min(len(hs), max(n_tokens - 1, 0) // block_size)
        while k < cap and hs[k] in seen:
            k += 1
        out.append(k * block_size)
        seen.update(hs)
    return out


def ideal_ttft_s(input_len: int, cached: int, chunk: int, model: PerfModel) -> float:
    """Seconds to the first token alone on an idle engine with ``cached`` prompt tokens already in KV."""
    return chunked_prefill_time(input_len - cached, cached, chunk, model)


def ideal_ttfts(lengths: Sequence[int], cached: Sequence[int], chunk: int, model: PerfModel) -> np.ndarray:
    """:func:`ideal_ttft_s` of every request (seconds), as an array indexed like ``lengths``."""
    return np.array([ideal_ttft_s(n, c, chunk, model) for n, c in zip(lengths, cached, strict=True)])
