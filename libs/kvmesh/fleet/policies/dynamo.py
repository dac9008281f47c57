"""Re-implementation of NVIDIA Dynamo's KV router cost (aggregated serving, temperature 0).

Source: ai-dynamo/dynamo, ``lib/llm/src/kv_router/scheduler.rs`` (``DefaultWorkerSelector::select_worker``,
later ``lib/kv-router/src/scheduling/selector.rs``) and ``docs/router/kv_cache_routing.md``:

    prefill_tokens(w) = Σ_{active r on w, still prefilling} new_tokens(r) + (isl − overlap_blocks(w) · bs)
    decode_blocks(w)  = |active blocks on w ∪ blocks of the request|      (shared blocks counted once)
    logit(w)          = overlap_score_weight · prefill_tokens(w) / bs + decode_blocks(w)

i.e. ``cost = prefill_load_scale · max(prefill_blocks − overlap_credit, 0) + decode_blocks``; the worker with
the lowest logit wins, ties broken uniformly at random (``softmax_sample`` at temperature 0). Active
sequences are the router's own book-keeping (``ActiveSequences``): added when routed, their prefill tokens
dropped at the first token, their blocks dropped at completion; overlaps come from the KV-event indexer
(here the simulated cache-manager index). Simplification: blocks of generated tokens are not added to the
active set (Dynamo grows it per generated block); default ``overlap_score_weight`` = 1.0.
"""

from __future__ import annotations

import random
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass

from kvmesh.fleet.policies.base import Policy
from kvmesh.routing.types import RoutingQuery, WorkerView


@dataclass(slots=True)
class _Active:
    worker: str
    new_tokens: int
    blocks: tuple[int, ...]
    partial: int
    prefilling: bool = True


class Dynamo(Policy):
    name = "dynamo"

    def __init__(self, overlap_score_weight: float = 1.0) -> None:
        self.w = overlap_score_weight
        self._rng = random.Random(0)
        self._active: dict[str, _Active] = {}
        self._prefill: dict[str, int] = {}
        self._blocks: dict[str, Counter[int]] = {}
        self._partial: dict[str, int] = {}

    def reset(self, worker_ids: Sequence[str], seed: int) -> None:
        self._rng = random.Random(seed)
        self._active = {}
        self._prefill = dict.fromkeys(worker_ids, 0)
        self._blocks = {w: Counter() for w in worker_ids}
        self._partial = dict.fromkeys(worker_ids, 0)

    @staticmethod
    def _partial_blocks(req: RoutingQuery) -> int:
        # request_blocks = ⌈isl/bs⌉: a trailing partial block is always new (it has no hash to share)
        return -(-req.prompt_tokens // req.block_size) - len(req.block_hashes)

    def logits(self, req: RoutingQuery, workers: Sequence[WorkerView]) -> list[float]:
        bs = req.block_size
        blocks = list(req.block_hashes)
        extra = self._partial_blocks(req)
        out = []
        for wv in workers:
            overlap = req.matches.get(wv.id, 0)
            new = max(req.prompt_tokens - overlap * bs, 0)
            prefill_tokens = self._prefill.get(wv.id, 0) + new
            active = self._blocks.get(wv.id, Counter())
            decode_blocks = (
                len(active) + self._partial.get(wv.id, 0) + extra + sum(1 for b in blocks if b not in active)
            )
            out.append(self.w * prefill_tokens / bs + decode_blocks)
        return out

    def choose(self, req: RoutingQuery, workers: Sequence[WorkerView], now: float) -> str:
        lg = self.logits(req, workers)
        best = min(lg)
        ties = [w.id for w, v in zip(workers, lg, strict=True) if v == best]
        return ties[0] if len(ties) == 1 else ties[self._rng.randrange(len(ties))]

    def on_routed(self, req: RoutingQuery, worker_id: str, now: float) -> None:
        overlap = req.matches.get(worker_id, 0)
        new = max(req.prompt_tokens - overlap * req.block_size, 0)
        a = _Active(worker_id, new, tuple(req.block_hashes), self._partial_blocks(req))
        self._active[req.request_id] = a
        self._prefill[worker_id] = self._prefill.get(worker_id, 0) + new
        self._blocks.setdefault(worker_id, Counter()).update(a.blocks)
        self._partial[worker_id] = self._partial.get(worker_id, 0) + a.partial

    def on_first_token(self, request_id: str, worker_id: str, now: float) -> None:
        a = self._active.get(request_id)
        if a is not None and a.prefilling:
            a.prefilling = False
            self._prefill[a.worker] -= a.new_tokens

    def on_finish(self, request_id: str, worker_id: str, now: float) -> None:
        a = self._active.pop(request_id, None)
        if a is None:
            return
        if a.prefilling:
            self._prefill[a.worker] -= a.new_tokens
        self._partial[a.worker] -= a.partial
        c = self._blocks[a.worker]
        c.subtract(a.blocks)
        for b in a.blocks:
            if c.get(b, 0) <= 0:
                c.pop(b, None)
