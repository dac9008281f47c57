"""The domain types of one generation request as every layer sees it: sampling, the request an engine
receives, its streamed outputs and usage, and a KV block moved between workers. Pure dataclasses, below the
wire codecs (`kvmesh.wire.proto` converts them) and the engines (`kvmesh.engine.base.Engine` takes them)."""

from __future__ import annotations

from dataclasses import dataclass, field

from kvmesh.core.handoff import KvHandoff
from kvmesh.core.pull import KvPull

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
    n: int = 1  # sequences from one prompt, on one engine (they share its KV)
    logprobs: int | None = None  # the sampled token's log-probability and this many alternatives
    prompt_logprobs: int | None = None
    min_p: float = 0.0
    logit_bias: tuple[tuple[int, float], ...] = ()  # (token id, bias), sorted by token id
    bad_words: tuple[str, ...] = ()
    allowed_token_ids: tuple[int, ...] = ()  # empty: every token
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True
    structured_output: StructuredOutput | None = None
    priority: int = 0


@dataclass(frozen=True, slots=True)
class StructuredOutput:
    """An output constraint (vLLM structured outputs): exactly one of its fields is set. `json_schema` is the
    schema as JSON text, so the type stays hashable and travels unchanged."""

    json_schema: str | None = None
    json_object: bool = False
    regex: str | None = None
    choice: tuple[str, ...] | None = None
    grammar: str | None = None

    @property
    def kind(self) -> str:
        """Which constraint is set: `json_schema`, `json_object`, `regex`, `choice` or `grammar`."""
        set_ = [k for k in ("json_schema", "regex", "choice", "grammar") if getattr(self, k) is not None]
        set_ += ["json_object"] if self.json_object else []
        if len(set_) != 1:
            raise ValueError(f"a structured output sets exactly one constraint, got {set_ or 'none'}")
        return set_[0]


@dataclass(frozen=True, slots=True)
class TokenLogprob:
    """One token's log-probability and its rank in the vocabulary at that position (1: the most likely)."""

    token_id: int
    logprob: float
    rank: int


@dataclass(frozen=True, slots=True)
class PositionLogprobs:
    """The log-probabilities at one position: the token there and the most likely alternatives."""

    token: TokenLogprob
    top: tuple[TokenLogprob, ...] = ()


@dataclass(frozen=True, slots=True)
class EngineRequest:
    """One generation request: token ids (preferred) or text, sampling, and flags.

    `prefill_only` computes and caches the prompt's KV blocks and finishes without sampling (warming).
    `kv_pull` is a pull the engine's `generate` loads leading blocks by (from `Engine.pull_prefix`).
    `resumed_output_tokens`: the prompt's last this-many tokens are the request's own output so far (it resumes
    from them after a migration): a structured output's grammar starts after them, not at the prompt's end.
    `hand_off_ms` makes it a disaggregated request's prefill half (implies `prefill_only`): the engine holds
    the prompt's KV that long and its last output carries the `KvHandoff`; `handoff` makes it a decode half,
    loading that KV (best effort: a failed or void handoff is computed). See `kvmesh.core.handoff`.
    """

    request_id: str
    prompt_token_ids: tuple[int, ...] | None = None
    prompt: str | None = None
    sampling: SamplingParams = field(default_factory=SamplingParams)
    prefill_only: bool = False
    lora_name: str | None = None
    tenant: str | None = None  # part of the prefix-cache salt: tenants never share KV blocks
    kv_pull: KvPull | None = None
    resumed_output_tokens: int = 0
    hand_off_ms: int = 0
    handoff: KvHandoff | None = None


@dataclass(frozen=True, slots=True)
class Usage:
    """Token accounting of one request: `cached_tokens` of the prompt were served from the prefix cache."""

    prompt_tokens: int
    cached_tokens: int
    completion_tokens: int


@dataclass(frozen=True, slots=True)
class EngineOutput:
    """A streamed delta of sequence `index`: new token ids (and text where the engine detokenises); `usage` on
    every output. With `n > 1`, `finished` ends sequence `index` only; the request is over once every
    sequence has finished, and the last output's `usage` counts every sequence's tokens."""

    request_id: str
    token_ids: tuple[int, ...] = ()
    text: str = ""
    finished: bool = False
    finish_reason: str | None = None
    usage: Usage | None = None
    time_s: float | None = None  # engine-clock time it became available (sim: virtual now + step duration)
    index: int = 0  # which of the request's `n` sequences this continues
    logprobs: tuple[PositionLogprobs, ...] = ()  # one per token id, when the request asked for them
    prompt_logprobs: tuple[PositionLogprobs | None, ...] = ()  # first output only; the first token has none
    handoff: KvHandoff | None = None  # a prefill half's last output: the KV held for the decode worker


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
