"""A client's request inside the router (`RouterRequest`), checked once, where it comes in.

Each door parses its own format (the gRPC servicer its message and sampling bounds, the HTTP API the OpenAI
body) and then builds the request with `RouterRequest.checked`, which applies the router's limits; nothing
else can build one, so the request path trusts every `RouterRequest` it is given and checks nothing again.
The checks, in order (the first that fails is the answer, InvalidArgument naming the field):

- the prompt: not empty, at most `max_prompt_tokens`;
- `max_tokens` (the request's, else `default_max_tokens`) at most `max_tokens_limit`;
- `resume_token_ids`, the tokens a client already has from a broken stream: at most `max_tokens`, only
  with `n = 1` (one list of tokens resumes one sequence); a structured output resumes too (the worker
  advances its grammar over them);
- prompt, stop, resumed, allowed and biased token ids within the vocabulary (a client's ids are checked
  before they become uint32, which an id of 2**40 would not fit).
"""

from __future__ import annotations

import dataclasses
import uuid
from collections.abc import Sequence
from dataclasses import InitVar, dataclass

from kvmesh.core.errors import InvalidArgument
from kvmesh.core.generation import SamplingParams
from kvmesh.services.router.limits import CoreLimits, check_token_ids
from kvmesh.wire.token_ids import TokenIdArray

_CHECKED = object()  # held only by `RouterRequest.checked`: a RouterRequest that exists has passed the checks


@dataclass(frozen=True, slots=True)
class RouterRequest:
    """A checked request (build it with `checked`): its prompt as sent to workers, sampling, the effective
    `max_tokens`, affinity session, tenant (the cache salt), resumed tokens and LoRA adapter."""

    request_id: str
    prompt: TokenIdArray
    sampling: SamplingParams
    max_tokens: int
    session_id: str
    tenant: str
    resume_ids: tuple[int, ...]
    lora: str
    door: InitVar[object] = None

    def __post_init__(self, door: object) -> None:
        if door is not _CHECKED:
            raise TypeError("a RouterRequest is built by RouterRequest.checked, which applies the router's limits")

    @classmethod
    def checked(
        cls,
        limits: CoreLimits,
        request_id: str,
        prompt: TokenIdArray | Sequence[int],
        sampling: SamplingParams,
        *,
        session_id: str = "",
        tenant: str = "",
        resume_ids: Sequence[int] = (),
        lora: str = "",
    ) -> RouterRequest:
        """The request, once it is within `limits` (see the module docstring); a new id when it has none."""
        n = len(prompt)
        if n == 0:
            raise InvalidArgument("prompt", "must not be empty")
        if n > limits.max_prompt_tokens:
            raise InvalidArgument("prompt", f"{n} tokens > limit {limits.max_prompt_tokens}")
        max_tokens = sampling.max_tokens or limits.default_max_tokens
        if max_tokens > limits.max_tokens_limit:
            raise InvalidArgument("max_tokens", f"{max_tokens} > limit {limits.max_tokens_limit}")
        if len(resume_ids) > max_tokens:
            raise InvalidArgument("resume_token_ids", f"{len(resume_ids)} tokens > max_tokens {max_tokens}")
        if resume_ids and sampling.n > 1:
            raise InvalidArgument("resume_token_ids", f"resumes one sequence, the request asks for n={sampling.n}")
        ids = prompt.array if isinstance(prompt, TokenIdArray) else prompt
        check_token_ids(ids, limits.vocab_size, "prompt")
        check_token_ids(sampling.stop_token_ids, limits.vocab_size, "stop_token_ids")
        check_token_ids(resume_ids, limits.vocab_size, "resume_token_ids")
        check_token_ids(sampling.allowed_token_ids, limits.vocab_size, "allowed_token_ids")
        check_token_ids([t for t, _ in sampling.logit_bias], limits.vocab_size, "logit_bias")
        tokens = prompt if isinstance(prompt, TokenIdArray) else TokenIdArray.of(prompt)
        rid = request_id or uuid.uuid4().hex
        return cls(rid, tokens, sampling, max_tokens, session_id, tenant, tuple(resume_ids), lora, _CHECKED)

    def sequence(self, index: int, so_far: Sequence[int]) -> RouterRequest:
        """Sequence `index` of this `n > 1` request as a request of its own, resumed after `so_far` (its
        tokens): `n = 1`, no prompt log-probabilities (the first attempt sent them), its own request id."""
        sampling = dataclasses.replace(self.sampling, n=1, prompt_logprobs=None)
        if sampling.seed is not None and sampling.temperature > 0:  # the engine sampled sequence i from seed + i
            sampling = dataclasses.replace(sampling, seed=sampling.seed + index)
        return RouterRequest(
            f"{self.request_id}-{index}",
            self.prompt,
            sampling,
            self.max_tokens,
            self.session_id,
            self.tenant,
            tuple(so_far),
            self.lora,
            _CHECKED,
        )
