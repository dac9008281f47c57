"""Validation of sampling parameters and prompt lengths: the one set of bounds, used by every engine, the
OpenAI HTTP parser (`kvmesh.openai.protocol`) and the gRPC servicers (raises InvalidArgument).

The bounds are vLLM's own (`vllm.SamplingParams._verify_args`, vLLM 0.32): temperature in [0, 2], top_p in
(0, 1], top_k -1, 0 (disabled) or positive, penalties in [-2, 2]. A request vLLM would refuse is refused
here, whichever door it came through.
"""

from __future__ import annotations

import json
import math

from kvmesh.core.errors import InvalidArgument
from kvmesh.core.generation import SamplingParams, StructuredOutput

TEMPERATURE_MAX = 2.0  # vLLM's cap (and OpenAI's)


def check_temperature(value: float, field: str = "temperature") -> None:
    """0 <= temperature <= TEMPERATURE_MAX, finite."""
    if not math.isfinite(value) or not 0 <= value <= TEMPERATURE_MAX:
        raise InvalidArgument(field, f"must be in [0, {TEMPERATURE_MAX}], got {value}")


def check_top_p(value: float, field: str = "top_p", zero_means_unset: bool = False) -> None:
    """0 < top_p <= 1, finite; `zero_means_unset` accepts 0 (the proto default, read as 1)."""
    if zero_means_unset and value == 0:
        return
    if not math.isfinite(value) or not 0 < value <= 1:
        raise InvalidArgument(field, f"must be in (0, 1], got {value}")


def check_top_k(value: int, field: str = "top_k") -> None:
    """-1, 0 (disabled) or positive."""
    if value < -1:
        raise InvalidArgument(field, f"must be -1, 0 (disabled) or positive, got {value}")


def check_penalties(presence: float, frequency: float, repetition: float) -> None:
    """Presence and frequency penalties in [-2, 2], repetition penalty > 0, all finite."""
    for name, value in (("presence_penalty", presence), ("frequency_penalty", frequency)):
        if not math.isfinite(value) or not -2 <= value <= 2:
            raise InvalidArgument(name, f"must be in [-2, 2], got {value}")
    if not math.isfinite(repetition) or repetition <= 0:
        raise InvalidArgument("repetition_penalty", f"must be > 0, got {repetition}")


def validate_sampling(p: SamplingParams, max_tokens_limit: int | None) -> None:
    """Raise `InvalidArgument(field, ...)` for the first out-of-range field (vLLM's own ranges);
    `max_tokens_limit=None` checks only max_tokens >= 1 (the engine checks its own limit later)."""
    if p.max_tokens is not None and not 1 <= p.max_tokens <= (max_tokens_limit or p.max_tokens):
        raise InvalidArgument("max_tokens", f"must be in [1, {max_tokens_limit or 'limit'}], got {p.max_tokens}")
    if p.min_tokens < 0 or (p.max_tokens is not None and p.min_tokens > p.max_tokens):
        raise InvalidArgument("min_tokens", f"must be in [0, max_tokens], got {p.min_tokens}")
    check_temperature(p.temperature)
    check_top_p(p.top_p)
    check_top_k(p.top_k)
    check_penalties(p.presence_penalty, p.frequency_penalty, p.repetition_penalty)
    if any(t < 0 for t in p.stop_token_ids):
        raise InvalidArgument("stop_token_ids", "token ids must be >= 0")
    if any(s == "" for s in p.stop):
        raise InvalidArgument("stop", "stop strings must be non-empty")
    check_extensions(p)


# vLLM's bounds: `n` >= 1 (kvmesh caps it, each sequence costs a full decode), `logprobs` up to the engine's
# max_logprobs (20 by default), `min_p` in [0, 1], a logit bias in [-100, 100] (OpenAI's range)
N_MAX = 16
LOGPROBS_MAX = 20
LOGIT_BIAS_MAX = 100.0


def check_extensions(p: SamplingParams) -> None:
    """The fields beyond OpenAI's basic sampling: `n`, log-probabilities, `min_p`, `logit_bias`, token lists,
    the structured output (exactly one constraint, a JSON schema that parses as an object)."""
    if not 1 <= p.n <= N_MAX:
        raise InvalidArgument("n", f"must be in [1, {N_MAX}], got {p.n}")
    for name, value in (("logprobs", p.logprobs), ("prompt_logprobs", p.prompt_logprobs)):
        if value is not None and not 0 <= value <= LOGPROBS_MAX:
            raise InvalidArgument(name, f"must be in [0, {LOGPROBS_MAX}], got {value}")
    if not math.isfinite(p.min_p) or not 0 <= p.min_p <= 1:
        raise InvalidArgument("min_p", f"must be in [0, 1], got {p.min_p}")
    for token, bias in p.logit_bias:
        if token < 0:
            raise InvalidArgument("logit_bias", f"token ids must be >= 0, got {token}")
        if not math.isfinite(bias) or not -LOGIT_BIAS_MAX <= bias <= LOGIT_BIAS_MAX:
            raise InvalidArgument("logit_bias", f"biases must be in [-100, 100], got {bias} for token {token}")
    if any(t < 0 for t in p.allowed_token_ids):
        raise InvalidArgument("allowed_token_ids", "token ids must be >= 0")
    if any(w.strip() == "" for w in p.bad_words):
        raise InvalidArgument("bad_words", "words must be non-empty")
    if p.structured_output is not None:
        check_structured_output(p.structured_output)


def check_structured_output(s: StructuredOutput) -> None:
    """Exactly one constraint; a JSON schema must parse as a JSON object, a choice list must be non-empty."""
    try:
        kind = s.kind
    except ValueError as exc:
        raise InvalidArgument("structured_outputs", str(exc)) from None
    if kind == "json_schema":
        try:
            schema = json.loads(s.json_schema or "")
        except ValueError as exc:
            raise InvalidArgument("structured_outputs.json", f"not valid JSON: {exc}") from None
        if not isinstance(schema, dict):
            raise InvalidArgument("structured_outputs.json", "a JSON schema must be an object")
    elif kind == "choice" and (not s.choice or any(c == "" for c in s.choice)):
        raise InvalidArgument("structured_outputs.choice", "must be a non-empty list of non-empty strings")
    elif kind in ("regex", "grammar") and not getattr(s, kind):
        raise InvalidArgument(f"structured_outputs.{kind}", "must be non-empty")


def resolve_max_tokens(p: SamplingParams, prompt_len: int, max_model_len: int, max_tokens_limit: int) -> int:
    """Completion budget: min(max_tokens or limit, max_model_len - prompt_len); raise if the prompt does
    not leave room for one token."""
    if prompt_len == 0:
        raise InvalidArgument("prompt", "prompt is empty")
    room = max_model_len - prompt_len
    if room < 1:
        raise InvalidArgument(
            "prompt", f"prompt has {prompt_len} tokens; the model's context is {max_model_len} tokens"
        )
    wanted = p.max_tokens if p.max_tokens is not None else max_tokens_limit
    if p.max_tokens is not None and wanted > room:
        raise InvalidArgument(
            "max_tokens",
            f"prompt ({prompt_len}) + max_tokens ({wanted}) exceeds the context of {max_model_len} tokens",
        )
    return min(wanted, room, max_tokens_limit)
