"""A request's sampling as vLLM takes it and its log-probabilities as vLLM gives them: kvmesh's
`SamplingParams` -> `vllm.SamplingParams` (every field, streaming deltas; a structured output as vLLM's
`StructuredOutputsParams`), and vLLM's per-position `Logprob` maps -> kvmesh's `PositionLogprobs`.
vLLM is imported inside the functions: this module loads without it."""

from __future__ import annotations

import json
import math
from collections.abc import Mapping, Sequence
from typing import Any

from kvmesh.core.generation import PositionLogprobs, SamplingParams, StructuredOutput, TokenLogprob

GREEDY_BELOW = 1e-5  # a temperature below this is greedy sampling (vLLM's _SAMPLING_EPS)


def to_vllm_sampling(p: SamplingParams, max_tokens: int) -> Any:
    """kvmesh SamplingParams -> vllm.SamplingParams streaming deltas (every field; vLLM checks the engine's
    own bounds, e.g. `max_logprobs` and the vocabulary, when the request is added)."""
    from vllm import SamplingParams as VSP
    from vllm.sampling_params import RequestOutputKind

    return VSP(
        n=p.n,
        max_tokens=max_tokens,
        min_tokens=p.min_tokens,
        temperature=p.temperature,
        top_p=p.top_p,
        top_k=p.top_k if p.top_k > 0 else -1,
        min_p=p.min_p,
        seed=p.seed,
        stop_token_ids=list(p.stop_token_ids),
        stop=list(p.stop),
        include_stop_str_in_output=p.include_stop_str_in_output,
        ignore_eos=p.ignore_eos,
        presence_penalty=p.presence_penalty,
        frequency_penalty=p.frequency_penalty,
        repetition_penalty=p.repetition_penalty,
        logprobs=p.logprobs,
        prompt_logprobs=p.prompt_logprobs,
        logit_bias=dict(p.logit_bias) or None,
        bad_words=list(p.bad_words) or None,
        allowed_token_ids=list(p.allowed_token_ids) or None,
        skip_special_tokens=p.skip_special_tokens,
        structured_outputs=to_vllm_structured(p.structured_output) if p.structured_output is not None else None,
        output_kind=RequestOutputKind.DELTA,
    )


def to_vllm_structured(s: StructuredOutput) -> Any:
    """kvmesh StructuredOutput -> vLLM's `StructuredOutputsParams` (a JSON schema as a dict)."""
    from vllm.sampling_params import StructuredOutputsParams

    kind = s.kind
    if kind == "json_schema":
        return StructuredOutputsParams(json=json.loads(s.json_schema or "{}"))
    if kind == "json_object":
        return StructuredOutputsParams(json_object=True)
    if kind == "choice":
        return StructuredOutputsParams(choice=list(s.choice or ()))
    if kind == "regex":
        return StructuredOutputsParams(regex=s.regex)
    return StructuredOutputsParams(grammar=s.grammar)


def to_position_logprobs(entry: Mapping[int, Any], token_id: int, k: int) -> PositionLogprobs:
    """One position of vLLM's log-probabilities (token id -> `Logprob(logprob, rank, decoded_token)`, the
    token there and the top-k) -> `PositionLogprobs`: `token_id`'s entry and the k most likely, by rank."""

    def one(tid: int, lp: Any) -> TokenLogprob:
        return TokenLogprob(tid, float(lp.logprob), int(lp.rank or 0))

    chosen = entry.get(token_id)
    token = one(token_id, chosen) if chosen is not None else TokenLogprob(token_id, float("-inf"), 0)
    ranked = sorted(entry.items(), key=lambda kv: kv[1].rank or math.inf)  # no rank: last
    return PositionLogprobs(token, tuple(one(t, lp) for t, lp in ranked[:k]))


def to_logprobs(
    entries: Sequence[Mapping[int, Any] | None] | None, token_ids: Sequence[int], k: int | None
) -> tuple[PositionLogprobs | None, ...]:
    """vLLM's per-position log-probabilities of `token_ids` (sampled or prompt; a None position, the
    prompt's first, stays None) -> kvmesh's; empty when not asked for."""
    if entries is None or k is None:
        return ()
    return tuple(None if e is None else to_position_logprobs(e, t, k) for e, t in zip(entries, token_ids, strict=False))
