"""Prefill/decode disaggregation in the fleet simulator: the pools, the handoff link, and the decision policies.

A P/D fleet (``FleetConfig.pd``) of N workers has ``prefill_workers`` = x prefill-only engines (role
``prefill``: they run prefill halves, never decode) and y = N − x decode engines (role ``decode``: decode
halves and the requests served aggregated), written "xPyD". Per request a :class:`Decider` says aggregated
(the policy routes it over the decode pool, as in an aggregated fleet) or disaggregated with a (prefill,
decode) pair. A disaggregated request runs as

1. the prefill half on the prefill worker: ``prefill_only``, ``max_tokens`` 1 (the router's first call);
2. the handoff: the KV of the prompt's tokens the decode worker does not already cache goes over the
   prefill worker's NIC out and the decode worker's NIC in (FIFO links, shared with the data plane's pulls):
   ``handoff_s = rtt + KV_tok · tokens / link``, ``link`` = ``link_gbps`` · 10⁹ / 8 B/s (the seeds'
   100 Gb/s RDMA per pod; 400 Gb/s as the alternative), KV_tok from the perf model;
3. the decode half on the decode worker, whose engine (:class:`HandoffEngineCore`) admits it with the
   handed-over KV already computed (all prompt tokens but the last, which yields the first token).

The request's TTFT is its decode half's first token (the router streams the decode worker's tokens); its
cache hit is the prefill worker's. The prefill worker's hold of the KV until the decode worker has read it
is not modelled (its blocks stay in its prefix cache, LRU, as after any request).

The deciders (what each router's code states; thresholds are theirs):

* ``kvmesh``: :func:`kvmesh.routing.disagg.decide` with the router's in-flight sums, its pair or aggregated.
* ``dynamo``: NVIDIA Dynamo's disaggregated router (conditional disaggregation, ``DisaggregatedRouter.
  prefill_remote`` in ai-dynamo/dynamo, ``examples/.../disagg_router.py``, docs/design_docs/disagg_serving.md):
  the decode worker is routed first; the prefill goes remote iff
  ``prompt − prefix_hit(decode worker) > max_local_prefill_length`` (default 1000) and the prefill queue
  (requests waiting on the prefill pool) is shorter than ``max_prefill_queue_size`` (default 2); else the
  decode worker prefills locally.
* ``llm_d``: llm-d's ``prefix-based-pd-decider`` (llm-d inference scheduler, ``PrefixBasedPDDecider.
  disaggregate``): the decode profile picks the decode pod first; disaggregate iff its non-cached tokens
  ``prompt − cached_blocks · block_size ≥ nonCachedTokens`` (16 in the project's P/D guides; 0 disables it).
* ``vllm_router``: the vLLM router's ``pd_uncached_token_threshold`` (default 256): disaggregate iff the
  uncached tokens on the decode worker it routed to reach the threshold.
* ``always``: every request disaggregated (vLLM's P/D proxy, SGLang's P/D router), with kvmesh's pair.

A peer's prefill worker is its own routing policy's choice over the prefill pool, its decode worker its
choice over the decode pool (each router runs its one policy on both pools).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING

from kvmesh.core.handoff import WorkerRole
from kvmesh.engine.sim.core import SimEngineCore
from kvmesh.fleet.policies.base import Policy
from kvmesh.routing.disagg import PdDecision, PdParams, decide
from kvmesh.routing.types import RoutingQuery, WorkerView

if TYPE_CHECKING:
    from kvmesh.engine.sim.core import _Seq

PD_DECIDERS = ("kvmesh", "dynamo", "llm_d", "vllm_router", "always")
# The routing policy each P/D policy routes with (the aggregated requests, and a peer's pair).
PD_ROUTING = {"kvmesh": "kvmesh", "dynamo": "dynamo", "llm_d": "llm_d", "vllm_router": "sglang", "always": "kvmesh"}


@dataclass(frozen=True, slots=True)
class PdFleet:
    """The P/D side of a fleet: x prefill workers (the first x slots; 0: no prefill pool, every request is
    served aggregated by the decode pool, the split that a trace gaining nothing picks), the handoff link, the
    decider, and the prefill engines' step budget and chunk (the decode engines run the fleet's own)."""

    prefill_workers: int
    decider: str = "kvmesh"
    link_gbps: float = 100.0
    link_rtt_s: float = 1e-3
    prefill_max_batched_tokens: int = 8192
    # per request: 8 prompts share a step, so a short prompt is not queued behind a long one (a whole-prompt
    # chunk makes the prefill engine first-come first-served: head-of-line blocking, TTFT p99 ×2 on the
    # development trace)
    prefill_chunk_tokens: int = 1024

    def split(self, workers: int) -> str:
        """'xPyD'."""
        return f"{self.prefill_workers}P{workers - self.prefill_workers}D"

    @property
    def link_bytes_per_s(self) -> float:
        return self.link_gbps * 1e9 / 8.0

    def handoff_s(self, tokens: int, kv_bytes_per_token: float) -> float:
        """rtt + KV_tok · tokens / link (module docstring); 0 for nothing to move."""
        if tokens <= 0:
            return 0.0
        return self.link_rtt_s + kv_bytes_per_token * tokens / self.link_bytes_per_s

    def check(self, workers: int) -> None:
        if not 0 <= self.prefill_workers < workers:
            raise ValueError(f"prefill_workers must be in [0, {workers - 1}] for {workers} workers")
        if self.decider not in PD_DECIDERS:
            raise ValueError(f"unknown decider {self.decider!r}; known: {', '.join(PD_DECIDERS)}")
        if self.link_gbps <= 0:
            raise ValueError("link_gbps must be > 0")


class HandoffEngineCore(SimEngineCore):
    """A decode engine: a request carrying a ``handoff`` is admitted with its prompt's KV computed but for the
    last token (the handed-over blocks; the last token's step yields the first output token), so its
    blocks enter the pool (and the index) as if prefilled here. Other requests are served as usual."""

    def _admit(self, seq: _Seq, now: float) -> bool:
        if not super()._admit(seq, now):
            return False
        if seq.req.handoff is not None and seq.num_computed < len(seq.tokens) - 1:
            seq.num_computed = len(seq.tokens) - 1
            self._register_full_blocks(seq, now)
        return True


@dataclass(frozen=True, slots=True)
class Choice:
    """A decider's answer: ``prefill``/``decode`` worker ids when disaggregated; aggregated otherwise (then
    ``decode`` may name the decode worker the decider routed to, else the policy routes)."""

    disaggregate: bool
    prefill: str | None = None
    decode: str | None = None
    reason: str = ""
    fallback: bool = False  # aggregated for a load reason (a busy prefill pool, a full decode worker)


def _uncached(req: RoutingQuery, worker: str) -> int:
    return max(req.prompt_tokens - req.matches.get(worker, 0) * req.block_size, 0)


class Decider:
    """Base: ``choose`` over the routable views of both pools."""

    name = "decider"

    def choose(self, req: RoutingQuery, views: Sequence[WorkerView], policy: Policy, now: float) -> Choice:
        raise NotImplementedError


def pools(views: Sequence[WorkerView]) -> tuple[list[WorkerView], list[WorkerView]]:
    """(prefill pool, decode pool) of ``views``."""
    return [v for v in views if v.role is WorkerRole.PREFILL], [v for v in views if v.role.decodes]


class KvmeshDecider(Decider):
    """:func:`kvmesh.routing.disagg.decide` over views carrying the policy's in-flight sums."""

    name = "kvmesh"

    def __init__(self, params: PdParams | None = None, always: bool = False) -> None:
        self.params = params or PdParams()
        if always:
            self.params = replace(
                self.params, min_uncached_tokens=0, max_prefill_queue_s=math.inf, max_decode_kv_usage=math.inf
            )
            self.name = "always"

    def choose(self, req: RoutingQuery, views: Sequence[WorkerView], policy: Policy, now: float) -> Choice:
        tracker = getattr(policy, "tracker", None)
        if tracker is not None:
            tracker.apply(views)
        d: PdDecision = decide(req, views, self.params)
        if d.disaggregate:
            return Choice(True, d.prefill_worker, d.decode_worker, d.reason)
        return Choice(False, reason=d.reason, fallback=d.reason in ("prefill-busy", "decode-full"))


class ThresholdDecider(Decider):
    """A peer's rule: the policy routes the decode worker first; disaggregate iff its uncached tokens pass
    ``min_uncached`` (``strict``: >, else ≥) and, when ``max_prefill_queue`` is set, fewer than that many
    requests wait on the prefill pool (Dynamo). The prefill worker is the policy's choice over the pool."""

    def __init__(self, name: str, min_uncached: int, strict: bool = False, max_prefill_queue: int | None = None):
        self.name = name
        self.min_uncached = min_uncached
        self.strict = strict
        self.max_prefill_queue = max_prefill_queue

    def choose(self, req: RoutingQuery, views: Sequence[WorkerView], policy: Policy, now: float) -> Choice:
        pre, dec = pools(views)
        d = policy.choose(req, dec, now)
        if not pre:
            return Choice(False, decode=d, reason="no-prefill-pool")
        u = _uncached(req, d)
        if (u <= self.min_uncached) if self.strict else (u < self.min_uncached):
            return Choice(False, decode=d, reason="short-prefill")
        if self.max_prefill_queue is not None and sum(v.waiting for v in pre) >= self.max_prefill_queue:
            return Choice(False, decode=d, reason="prefill-busy", fallback=True)
        return Choice(True, policy.choose(req, pre, now), d, "disaggregate")


def make_decider(name: str) -> Decider:
    """The decider ``name`` (one of :data:`PD_DECIDERS`) with its router's default thresholds."""
    if name == "kvmesh":
        return KvmeshDecider()
    if name == "always":
        return KvmeshDecider(always=True)
    if name == "dynamo":
        return ThresholdDecider("dynamo", 1000, strict=True, max_prefill_queue=2)
    if name == "llm_d":
        return ThresholdDecider("llm_d", 16)
    if name == "vllm_router":
        return ThresholdDecider("vllm_router", 256)
    raise ValueError(f"unknown decider {name!r}; known: {', '.join(PD_DECIDERS)}")
