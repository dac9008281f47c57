"""A structured output resumed mid-way on a vLLM worker: its grammar advanced over the output already sent.

A request that fails after tokens resumes on another worker from prompt + its tokens so far. vLLM's structured
outputs start their grammar at the first token the engine generates, so a resumed request's grammar would
start a new JSON document in the middle of the one the client already holds. vLLM has no "start this grammar
after these tokens" parameter, so a resumed request carries its grammar to `ResumedGrammar`, a vLLM logits
processor registered on the engine (`LOGITS_PROCESSOR`), instead of `structured_outputs`:

- the worker validates the grammar with vLLM's own checks (`SamplingParams.verify`, which also picks the
  backend as `--structured-outputs-config` says) and moves it, as vLLM's own key (kind, spec) and backend, into
  `extra_args[EXTRA_ARG]` with the number of resumed tokens (`resumed_params`);
- in the engine, the processor compiles it with vLLM's backend (xgrammar or guidance, as vLLM's
  `StructuredOutputManager` would), advances it over the prompt's last `resumed` tokens, then before each step
  over the token sampled last, and masks the logits to what the grammar allows next; once the grammar has
  terminated (it accepted a stop token) it masks nothing, as vLLM does.

The processor holds no state for requests without the argument and returns their logits untouched; the
backend (a tokenizer and a grammar compiler) is built on the first resumed request, so a worker that never
resumes one never pays for it. Speculative decoding is not combined with it (vLLM's custom logits processors
see one token per step).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch
from vllm.sampling_params import SamplingParams
from vllm.v1.sample.logits_processor import BatchUpdate, LogitsProcessor
from vllm.v1.sample.logits_processor.builtin import process_dict_updates

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.v1.structured_output.backend_types import StructuredOutputBackend, StructuredOutputGrammar

log = logging.getLogger(__name__)

LOGITS_PROCESSOR = f"{__name__}:ResumedGrammar"
EXTRA_ARG = "kvmesh_resumed_grammar"
BACKENDS = ("xgrammar", "guidance")


def resumed_params(params: SamplingParams, resumed: int, vllm_config: Any, tokenizer: Any) -> SamplingParams:
    """`params` of a request resuming after its last `resumed` prompt tokens: its `structured_outputs`
    checked by vLLM (`verify` raises vLLM's validation error, as a fresh request's would) and moved into the
    processor's argument. Unchanged without a structured output or resumed tokens."""
    from vllm.v1.structured_output.request import get_structured_output_key

    so = params.structured_outputs
    if so is None or resumed <= 0:
        return params
    params.verify(
        vllm_config.model_config, vllm_config.speculative_config, vllm_config.structured_outputs_config, tokenizer
    )
    backend = so._backend
    if backend not in BACKENDS:
        # vLLM picked a backend this processor does not drive (outlines, lm-format-enforcer)
        from vllm.exceptions import VLLMValidationError

        raise VLLMValidationError(
            f"a structured output resumed mid-way needs the xgrammar or guidance backend, not {backend!r}",
            parameter="structured_outputs",
        )
    kind, spec = get_structured_output_key(so)
    params.structured_outputs = None
    arg = {"backend": backend, "kind": kind.name, "spec": spec, "resumed": resumed}
    params.extra_args = {**(params.extra_args or {}), EXTRA_ARG: arg}
    return params


@dataclass(slots=True)
class _Row:
    """One resumed request in the batch: its grammar and how much of its live output list it has taken."""

    grammar: StructuredOutputGrammar
    output_ids: list[int]  # vLLM's list for the request, appended to in place as tokens are sampled
    taken: int = 0
    broken: bool = False


class ResumedGrammar(LogitsProcessor):
    """vLLM logits processor: constrains resumed structured-output requests (see the module docstring)."""

    def __init__(self, vllm_config: VllmConfig, device: torch.device, is_pin_memory: bool) -> None:
        self._config = vllm_config
        self._max_rows = vllm_config.scheduler_config.max_num_seqs
        self._backends: dict[str, StructuredOutputBackend] = {}
        self._rows: dict[int, _Row] = {}
        self._bitmask: torch.Tensor | None = None

    @classmethod
    def validate_params(cls, sampling_params: SamplingParams) -> None:
        arg = (sampling_params.extra_args or {}).get(EXTRA_ARG)
        if arg is None:
            return
        from vllm.exceptions import VLLMValidationError
        from vllm.v1.structured_output.backend_types import StructuredOutputOptions

        ok = (
            isinstance(arg, dict)
            and arg.get("backend") in BACKENDS
            and arg.get("kind") in StructuredOutputOptions.__members__
            and isinstance(arg.get("spec"), str)
            and isinstance(arg.get("resumed"), int)
            and arg["resumed"] > 0
        )
        if not ok:
            raise VLLMValidationError(f"malformed {EXTRA_ARG}: {arg!r}", parameter=EXTRA_ARG)

    def is_argmax_invariant(self) -> bool:
        return False  # it decides which tokens may come next, greedy or not

    def update_state(self, batch_update: BatchUpdate | None) -> None:
        process_dict_updates(self._rows, batch_update, self._new_row)
        for row in self._rows.values():
            new = row.output_ids[row.taken :]
            if new and not row.broken:
                row.broken = not row.grammar.accept_tokens(EXTRA_ARG, list(new))
                if row.broken:  # cannot happen while the mask holds; constraining from a wrong state would be worse
                    log.error("resumed grammar rejected tokens %s; the rest of the output is unconstrained", new)
            row.taken = len(row.output_ids)

    def apply(self, logits: torch.Tensor) -> torch.Tensor:
        rows = [(i, r) for i, r in self._rows.items() if not r.broken and not r.grammar.is_terminated()]
        if not rows:
            return logits
        import xgrammar as xgr

        if self._bitmask is None:
            self._bitmask = xgr.allocate_token_bitmask(self._max_rows, logits.shape[-1])
        bitmask = self._bitmask
        indices = [i for i, _ in rows]
        for i, r in rows:
            r.grammar.fill_bitmask(bitmask, i)
        # xgrammar's CPU kernel takes float32 logits (vLLM converts the same way in apply_grammar_bitmask)
        target = logits if logits.dtype == torch.float32 else logits.float()
        xgr.apply_token_bitmask_inplace(target, bitmask[: logits.shape[0]].to(logits.device), indices=indices)
        if target is not logits:
            logits.copy_(target)
        return logits

    def _new_row(self, params: SamplingParams, prompt_ids: list[int] | None, output_ids: list[int]) -> _Row | None:
        arg = (params.extra_args or {}).get(EXTRA_ARG)
        if arg is None:
            return None
        from vllm.v1.structured_output.backend_types import StructuredOutputOptions

        backend = self._backend(arg["backend"])
        grammar = backend.compile_grammar(
            StructuredOutputOptions[arg["kind"]], arg["spec"], stop_token_ids=params.all_stop_token_ids
        )
        resumed = list((prompt_ids or [])[-int(arg["resumed"]) :])
        row = _Row(grammar, output_ids)
        if not grammar.accept_tokens(EXTRA_ARG, resumed):
            log.error("resumed grammar rejected the tokens it resumes from; the output is unconstrained")
            row.broken = True
        return row

    def _backend(self, name: str) -> StructuredOutputBackend:
        """vLLM's backend `name`, built as its `StructuredOutputManager` builds it (once per processor)."""
        if name not in self._backends:
            from vllm.tokenizers import cached_tokenizer_from_config

            tokenizer = cached_tokenizer_from_config(model_config=self._config.model_config)
            vocab_size = self._config.model_config.get_vocab_size()
            if name == "xgrammar":
                from vllm.v1.structured_output.backend_xgrammar import XgrammarBackend

                self._backends[name] = XgrammarBackend(self._config, tokenizer=tokenizer, vocab_size=vocab_size)
            else:
                from vllm.v1.structured_output.backend_guidance import GuidanceBackend

                self._backends[name] = GuidanceBackend(self._config, tokenizer=tokenizer, vocab_size=vocab_size)
        return self._backends[name]
