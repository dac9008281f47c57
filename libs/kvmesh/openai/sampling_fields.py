"""An OpenAI request's sampling fields (pure): OpenAI's and vLLM's extensions read into one
`kvmesh.core.generation.SamplingParams` as vLLM 0.32 reads them, range-checked by `kvmesh.core.sampling` (the
same bounds as gRPC's), each bad value an `InvalidArgument` naming the field as the client named it
(`max_completion_tokens`, `top_logprobs`). The output constraint is `kvmesh.openai.structured`'s.
"""

from __future__ import annotations

from typing import Any

from kvmesh.core.errors import InvalidArgument
from kvmesh.core.generation import SamplingParams
from kvmesh.core.sampling import validate_sampling
from kvmesh.openai.structured import parse_structured_output
from kvmesh.openai.values import bool_field, check_text, float_field, int_field, strings, token_ids

SEED_MAX = 2**63 - 1  # int64 in vLLM, uint64 on kvmesh's wire: [0, 2**63) fits both
PRIORITY_MIN, PRIORITY_MAX = -(2**31), 2**31 - 1  # kvmesh's wire carries an int32 (vLLM's is unbounded)


def parse_sampling(
    body: dict[str, Any], chat: bool, max_tokens_limit: int | None, default_max_tokens: int | None
) -> SamplingParams:
    """The sampling fields, type-checked here and range-checked by `validate_sampling` (gRPC's bounds)."""
    max_key = "max_completion_tokens" if chat and body.get("max_completion_tokens") is not None else "max_tokens"
    int_field(body, "max_tokens", None)  # typed even when max_completion_tokens wins
    seed = int_field(body, "seed", None)
    if seed is not None and not 0 <= seed <= SEED_MAX:
        raise InvalidArgument("seed", f"must be in [0, {SEED_MAX}], got {seed}")
    logprobs = _logprobs(body, chat)
    sp = SamplingParams(
        max_tokens=int_field(body, max_key, default_max_tokens),
        min_tokens=int_field(body, "min_tokens", 0),
        temperature=float_field(body, "temperature", 1.0),
        top_p=float_field(body, "top_p", 1.0),
        top_k=int_field(body, "top_k", 0),
        seed=seed,
        stop=_stop(body),
        stop_token_ids=token_ids(body, "stop_token_ids"),
        ignore_eos=bool_field(body, "ignore_eos"),
        presence_penalty=float_field(body, "presence_penalty", 0.0),
        frequency_penalty=float_field(body, "frequency_penalty", 0.0),
        repetition_penalty=float_field(body, "repetition_penalty", 1.0),
        n=_n(body),
        logprobs=logprobs,
        prompt_logprobs=_prompt_logprobs(body, chat, logprobs),
        min_p=float_field(body, "min_p", 0.0),
        logit_bias=_logit_bias(body),
        bad_words=strings(body, "bad_words"),
        allowed_token_ids=_allowed_token_ids(body),
        include_stop_str_in_output=bool_field(body, "include_stop_str_in_output"),
        skip_special_tokens=bool_field(body, "skip_special_tokens", default=True),
        structured_output=parse_structured_output(body),
        priority=_priority(body),
    )
    # the bound of the limit (and of the log-probabilities) named as the client named it
    renamed = {"max_tokens": max_key, "logprobs": "top_logprobs" if chat else "logprobs"}
    try:
        validate_sampling(sp, max_tokens_limit)
    except InvalidArgument as e:
        name = renamed.get(e.field, e.field)
        raise (InvalidArgument(name, e.message.removeprefix(f"{e.field}: ")) if name != e.field else e) from None
    return sp


def _stop(body: dict[str, Any]) -> tuple[str, ...]:
    stop = body.get("stop")
    if stop is None:
        return ()
    if isinstance(stop, str):
        return (check_text(stop, "stop"),)
    if isinstance(stop, list) and all(isinstance(s, str) for s in stop):
        return tuple(check_text(s, "stop") for s in stop)
    raise InvalidArgument("stop", "must be a string or a list of strings")


def _n(body: dict[str, Any]) -> int:
    """`n` (1 by default); `best_of`, which vLLM 0.32's server no longer has (it ignores the key), only as `n`."""
    n: int = int_field(body, "n", 1)
    best_of = int_field(body, "best_of", None)
    if best_of is not None and best_of != n:
        raise InvalidArgument("best_of", f"vLLM 0.32 has no best_of beyond n: only {n} (n) is accepted")
    return n


def _logprobs(body: dict[str, Any], chat: bool) -> int | None:
    """`SamplingParams.logprobs`: chat's `logprobs: true` with `top_logprobs` (0 by default; without
    `logprobs: true` only 0, as vLLM), or completions' `logprobs` (an integer)."""
    if not chat:
        return int_field(body, "logprobs", None)
    top = int_field(body, "top_logprobs", None)
    if not bool_field(body, "logprobs"):
        if top:
            raise InvalidArgument("top_logprobs", "when using `top_logprobs`, `logprobs` must be set to true")
        return None
    return top or 0


def _prompt_logprobs(body: dict[str, Any], chat: bool, logprobs: int | None) -> int | None:
    """`prompt_logprobs`; a completion's `echo` asks for `logprobs`' worth of them when it is not given (as
    vLLM); not with a stream (a value above 0, as vLLM: its stream has no place for them)."""
    value: int | None = int_field(body, "prompt_logprobs", None)
    if value is None and not chat and bool_field(body, "echo"):
        value = logprobs
    if body.get("prompt_logprobs") and body.get("stream") is True:
        raise InvalidArgument("prompt_logprobs", "`prompt_logprobs` are not available when `stream=True`")
    return value


def _logit_bias(body: dict[str, Any]) -> tuple[tuple[int, float], ...]:
    """OpenAI's {"<token id>": bias} as sorted (id, bias) pairs, each bias clamped to [-100, 100] (as vLLM)."""
    v = body.get("logit_bias")
    if v is None:
        return ()
    if not isinstance(v, dict):
        raise InvalidArgument("logit_bias", "must be an object of token id -> bias")
    out = {}
    for key, bias in v.items():
        if not (key.isascii() and key.isdigit()):
            raise InvalidArgument("logit_bias", f"keys must be token ids, got {key!r}")
        if not isinstance(bias, int | float) or isinstance(bias, bool):
            raise InvalidArgument("logit_bias", f"the bias of token {key} must be a number")
        out[int(key)] = min(100.0, max(-100.0, float(bias)))
    return tuple(sorted(out.items()))


def _allowed_token_ids(body: dict[str, Any]) -> tuple[int, ...]:
    """`allowed_token_ids`: absent, or a non-empty list (vLLM refuses `[]`)."""
    ids = token_ids(body, "allowed_token_ids")
    if body.get("allowed_token_ids") == []:
        raise InvalidArgument("allowed_token_ids", "must not be empty")
    return ids


def _priority(body: dict[str, Any]) -> int:
    """`priority` (lower is served first, as vLLM), within the wire's int32."""
    v: int = int_field(body, "priority", 0)
    if not PRIORITY_MIN <= v <= PRIORITY_MAX:
        raise InvalidArgument("priority", f"must be in [{PRIORITY_MIN}, {PRIORITY_MAX}] (32 bits), got {v}")
    return v
