"""The simulated engine as the fleet simulator drives it.

:class:`TrustedTokensCore` is ``kvmesh.engine.sim.core.SimEngineCore`` with one change: ``add_request``
skips the per-token Python range check (``0 ≤ t < vocab_size`` for every prompt token), which costs ~0.2 µs
per token (≈30 s per replay of the Mooncake hour). The simulator checks the whole prompt with one numpy
``min``/``max`` instead (:func:`check_tokens`). Everything else (queueing, admission, scheduling, timing,
KV events) is the engine's own code.
"""

from __future__ import annotations

import math
import struct
import zlib

import numpy as np

from kvmesh.engine.base import EngineRequest
from kvmesh.engine.sim.core import SimEngineCore, _Seq
from kvmesh.engine.validation import resolve_max_tokens, validate_sampling
from kvmesh.errors import InvalidArgument, ResourceExhausted


def check_tokens(tokens: np.ndarray, vocab_size: int) -> None:
    """Raise InvalidArgument unless every token id is in [0, vocab_size) (vectorised)."""
    if tokens.size and (int(tokens.min()) < 0 or int(tokens.max()) >= vocab_size):
        raise InvalidArgument("prompt_token_ids", f"token ids must be in [0, {vocab_size})")


class TrustedTokensCore(SimEngineCore):
    """SimEngineCore whose caller has already range-checked the prompt (see module docstring)."""

    def add_request(self, req: EngineRequest, now: float) -> None:
        cfg = self.config
        if req.request_id in self._by_id:
            raise InvalidArgument("request_id", f"{req.request_id!r} is already in flight")
        if req.prompt_token_ids is None:
            raise InvalidArgument("prompt_token_ids", "the simulated engine needs token ids")
        validate_sampling(req.sampling, cfg.max_tokens_limit)
        prompt = list(req.prompt_token_ids)
        max_tokens = resolve_max_tokens(req.sampling, len(prompt), cfg.max_model_len, cfg.max_tokens_limit)
        need = math.ceil((len(prompt) + 1) / cfg.block_size)
        if need > cfg.kv_admission_threshold * self.pool.num_blocks:
            raise InvalidArgument(
                "prompt_token_ids",
                f"prompt needs {need} KV blocks; this worker admits at most "
                f"{int(cfg.kv_admission_threshold * self.pool.num_blocks)}",
            )
        if len(self._waiting) >= cfg.max_waiting:
            self.rejected_total += 1
            raise ResourceExhausted(f"waiting queue full ({cfg.max_waiting})", retry_after_s=self.estimated_drain_s())
        if req.sampling.seed is not None:
            seed = req.sampling.seed
        elif req.sampling.temperature == 0.0:
            seed = zlib.crc32(struct.pack(f"<{len(prompt)}q", *prompt))
        else:
            seed = zlib.crc32(req.request_id.encode())
        seq = _Seq(req=req, tokens=prompt, prompt_len=len(prompt), max_tokens=max_tokens, arrival=now, seed=seed)
        self._hash_full_blocks(seq, len(prompt) // cfg.block_size)
        self._waiting.append(seq)
        self._by_id[req.request_id] = seq
