"""The per-request prefill/decode decision: run request r aggregated on one worker, or disaggregated (its
prefill half on a prefill worker, the KV handed over, its decode half on a decode worker).

For r (P prompt tokens, block size b), prefill workers p (role `prefill`) and decode workers d (role
`decode` or `both`), every term in seconds, s(w) = w's prefill time per token (its transfer costs, else
`PdParams.prefill_s_per_token`):

    u(w)       = P − cached(w),   cached(w) = min(max(tier_matches[w], matches[w]) · b, P)   tokens to prefill
    queue(w)   = (prefill_tokens_queued(w) + inflight_prefill_tokens(w)) · s(w)          w's prefill backlog
    p*         = argmin_p  queue(p) + u(p) · s(p)                       prefix overlap and prefill load
    handoff(d) = rtt(d) + ⌊(P − 1) / b⌋ · block_pull_s(d) · link(p*, d)
                 link = `same_host` (1/10 by default: shared memory), `same_rack`, `same_zone` (1) or
                 `other_zone` (10) by the workers' topology labels
    load(d)    = (decode_tokens_active(d) + inflight_decode_tokens(d)) / max_decode_tokens + kv_usage(d)
    d*         = argmin_d  load(d) + handoff(d) / handoff_scale        decode load and headroom, then locality

    remote     = queue(p*) + u(p*) · s(p*) + handoff(d*)      first token's wait, disaggregated
    local      = queue(d*) + u(d*) · s(d*)                     first token's wait, prefilled in place on d*

    disaggregate ⇔ prefill and decode pools both non-empty
                 ∧ u(p*) ≥ min_uncached_tokens                  (a short prefill is cheaper in place)
                 ∧ ¬(queue(p*) > max_prefill_queue_s ∧ local < remote)
                                                  (a busy prefill pool: prefill in place, if that is sooner)
                 ∧ kv_usage(d*) < max_decode_kv_usage            (the decode worker can hold the KV)

A prefill in place costs the decode worker's running requests its compute time (their ITL), which is why
a busy prefill pool alone is not enough: in place must also be sooner. `max_prefill_queue_s` defaults to
the TTFT SLO of the fleet evaluation (2 s): beyond it the request's TTFT is lost if it waits.
`max_decode_kv_usage` defaults to 1 (off): with pure pools an aggregated request lands on the same full
decode pool, so the fallback only helps where `both` workers exist (set it below 1 there).

Pure: no I/O, no clock. The live router (`kvmesh.services.router.disaggregation`) and the fleet simulator
call `decide` with the same views.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

from kvmesh.core.handoff import WorkerRole
from kvmesh.routing.types import RoutingQuery, WorkerView


@dataclass(frozen=True, slots=True)
class PdParams:
    """The decision's thresholds and link factors (the module docstring's symbols)."""

    min_uncached_tokens: int = 256
    max_prefill_queue_s: float = 2.0
    max_decode_kv_usage: float = 1.0
    max_decode_tokens: int = 65536
    handoff_scale: float = 1.0
    prefill_s_per_token: float = 1.43e-4
    same_host: float = 0.1
    same_rack: float = 1.0
    same_zone: float = 1.0
    other_zone: float = 10.0


@dataclass(frozen=True, slots=True)
class PdDecision:
    """Aggregated (`disaggregate` False: the routing profile picks a decode-capable worker) or the pair
    (`prefill_worker`, `decode_worker`). `reason` names the condition that decided; `terms` the figures."""

    disaggregate: bool
    prefill_worker: str | None = None
    decode_worker: str | None = None
    reason: str = ""
    terms: dict[str, float] = field(default_factory=dict)


def _uncached(req: RoutingQuery, w: WorkerView) -> int:
    blocks = max(req.tier_matches.get(w.id, 0), req.matches.get(w.id, 0))
    return max(req.prompt_tokens - min(blocks * req.block_size, req.prompt_tokens), 0)


def link_factor(a: WorkerView, b: WorkerView, params: PdParams) -> float:
    """The handoff's per-block cost factor between two workers, by their topology labels."""
    if a.zone and b.zone and a.zone != b.zone:
        return params.other_zone
    if a.host and a.host == b.host:
        return params.same_host
    if a.rack and a.rack == b.rack:
        return params.same_rack
    return params.same_zone


def decide(req: RoutingQuery, workers: Sequence[WorkerView], params: PdParams | None = None) -> PdDecision:
    """The decision of the module docstring over the routable `workers`."""
    pr = params or PdParams()
    prefill = [w for w in workers if w.routable and w.role is WorkerRole.PREFILL]
    decode = [w for w in workers if w.routable and w.role.decodes]
    if not prefill or not decode:
        return PdDecision(False, reason="no-prefill-pool" if not prefill else "no-decode-pool")

    def s(w: WorkerView) -> float:
        return w.transfer.prefill_s_per_token if w.transfer is not None else pr.prefill_s_per_token

    def queue(w: WorkerView) -> float:
        return (w.prefill_tokens_queued + w.inflight_prefill_tokens) * s(w)

    p = min(prefill, key=lambda w: (queue(w) + _uncached(req, w) * s(w), w.id))
    u, q = _uncached(req, p), queue(p)
    blocks = max(req.prompt_tokens - 1, 0) // req.block_size

    def handoff(d: WorkerView) -> float:
        if d.transfer is None:
            return 0.0
        return d.transfer.pull_rtt_s + blocks * d.transfer.block_pull_s * link_factor(p, d, pr)

    def load(d: WorkerView) -> float:
        return (d.decode_tokens_active + d.inflight_decode_tokens) / max(pr.max_decode_tokens, 1) + d.kv_usage

    d = min(decode, key=lambda w: (load(w) + handoff(w) / pr.handoff_scale, w.id))
    remote = q + u * s(p) + handoff(d)
    local = queue(d) + _uncached(req, d) * s(d)
    terms = {
        "uncached_tokens": float(u),
        "prefill_queue_s": q,
        "handoff_s": handoff(d),
        "decode_load": load(d),
        "remote_s": remote,
        "local_s": local,
    }
    if u < pr.min_uncached_tokens:
        return PdDecision(False, p.id, d.id, "short-prefill", terms)
    if q > pr.max_prefill_queue_s and local < remote:
        return PdDecision(False, p.id, d.id, "prefill-busy", terms)
    if d.kv_usage >= pr.max_decode_kv_usage:
        return PdDecision(False, p.id, d.id, "decode-full", terms)
    return PdDecision(True, p.id, d.id, "disaggregate", terms)
