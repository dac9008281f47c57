"""The default routing cost: prefill, decode-interference and decode load on one shared token scale.

For request r (prompt tokens, max_tokens = out) and candidate worker w:

    n(w)    = max(prompt - overlap(w), 0)                          tokens r must prefill on w
    Q(w)    = prefill_tokens_queued(w) + inflight_prefill_tokens(w) prefill work already on w
    T(w)    = n(w) + min(Q(w), k·n(w))     (k = prefill_slots; k = 0 → n(w) + Q(w))
    I(w)    = max(Q(w) - n(w), 0) / max(out - 1, 1)
    E(w)    = max(n(w) - f, 0) · R(w),   R(w) = max(running(w) - ended_requests(w), inflight_requests(w))
    D(w)    = decode_tokens_active(w) + inflight_decode_tokens(w)
    alpha   = prefill_weight / (prefill_weight + decode_weight),  g = itl_weight,  e = interference_weight,
    f       = interference_floor
    X(w)    = g·I(w) + e·E(w)
    S       = max(max_c T(c), max_c X(c), max_c D(c), 1)           over the candidates c
    cost(w) = (alpha·T(w) + X(w) + (1 - alpha)·D(w)) / S

Why each term (chunked prefill, vLLM v1 scheduling: every prefilling sequence gets one chunk of at most
`prefill_chunk_tokens` per step, up to k = max_batched_tokens / prefill_chunk_tokens of them at once):

* T — r's time to first token, in prefill tokens. Its chunks share steps with the prefills already on w,
  and a prefill of q_i tokens delays r's n tokens by at most min(q_i, n): Σ_i min(q_i, n) ≤ min(Q, k·n).
  A request that hits most of its prompt in w's cache (small n) is therefore fast on w even behind a long
  queue: this is what keeps conversations on their cache. k = 0 charges the whole queue (FIFO prefill).
* I — r's inter-token latency: the queued prefill that outlives r's own (Q − n) runs in the same steps as
  r's out − 1 decode steps, so each of r's tokens waits for (Q − n)/(out − 1) prefill tokens. Short
  outputs are the requests whose mean ITL a co-running long prefill breaks; g weighs that against TTFT
  (g = ttft_slo/itl_slo = 20 puts both in units of their SLO budgets; the default 10 was picked on a
  held-out window of the Mooncake trace, see docs/fleet-report/).
* E — what r's prefill does to the others: each of the running(w) sequences on w shares its steps with r's
  n(w) prefill tokens, i.e. waits n(w) more prefill tokens; for a decoding sequence with a short output that
  is what breaks its mean ITL. The router does not know the others' output lengths, so every running sequence
  counts (e = 0.25 picked on the held-out window). It sends cold long prompts to idle workers rather than onto
  a worker that is finishing a short request. Only the prefill beyond f tokens counts: a prefill within one
  engine step's token budget (f = max_batched_tokens) delays each running sequence by about one step, which a
  mean ITL absorbs. With f = 0 every token counts, and on a cache-free workload of short prompts (the Azure
  lengths, ~1K tokens) E then ranks workers by their running count and outweighs their queued prefill:
  kvmesh's ITL p99 there was 138 ms where dynamo's was 77 (docs/fleet-report/). R(w) is the report's count
  less this router's requests in it that have ended since, but never below this router's own requests on w: a
  report lags both ways (taken before requests sent to w reached it, or before some of its requests finished),
  and a count that misses the first lets a burst of prompts all see w as idle, one that keeps the second sends
  them all elsewhere.
* D — the KV resident on w (decode batch size and memory); with the shared scale it also bounds herding.

All terms are in tokens and divided by the *same* S, so the ranking is that of alpha·T + X + (1-alpha)·D.
This matters for herding: with per-term normalisation the cached worker's decode term would be capped at 1
however loaded it gets, and a shared system prompt would send every request to it. On a shared scale each
request added to w raises D(w) by its prompt length, so w stops winning once (1-alpha)·D(w) exceeds what
another worker saves: at most about alpha/(1-alpha) · (prompt saved / prompt) extra requests per worker.
With g = e = 0 and k = 0 this is the earlier cost alpha·P + (1-alpha)·D, P = n + Q. `set_weights` changes
alpha. Only load-report and in-flight fields of `WorkerView` are used, so the live router computes the same.
With a KV data plane (`req.tier_matches` and `w.transfer` set) n(w) is `kvmesh.routing.dataplane.plan_prefix`'s
time in prefill tokens: blocks w can load from its own tier or pull from a peer cost their transfer time.
"""

from __future__ import annotations

from collections.abc import Sequence

from kvmesh.routing.dataplane import plan_prefix, sources_of
from kvmesh.routing.plugin import SCORERS, register
from kvmesh.routing.types import RoutingQuery, WorkerView


@register(SCORERS, "cost")
class CostScorer:
    """cost(w) = (alpha·T(w) + g·I(w) + e·E(w) + (1-alpha)·D(w)) / S, E = max(n - f, 0)·R   (module docstring)"""

    name = "cost"

    def __init__(
        self,
        prefill_weight: float = 0.5,
        decode_weight: float = 0.5,
        itl_weight: float = 0.0,
        prefill_slots: int = 0,
        interference_weight: float = 0.0,
        interference_floor: int = 0,
    ) -> None:
        if itl_weight < 0:
            raise ValueError("itl_weight must be >= 0")
        if prefill_slots < 0:
            raise ValueError("prefill_slots must be >= 0")
        if interference_weight < 0:
            raise ValueError("interference_weight must be >= 0")
        if interference_floor < 0:
            raise ValueError("interference_floor must be >= 0")
        self.alpha = 0.5
        self.itl_weight = itl_weight
        self.prefill_slots = prefill_slots
        self.interference_weight = interference_weight
        self.interference_floor = interference_floor
        self.set_weights(prefill_weight, decode_weight)

    def set_weights(self, prefill_weight: float, decode_weight: float) -> None:
        """alpha = prefill_weight / (prefill_weight + decode_weight); both ≥ 0, not both 0."""
        if prefill_weight < 0 or decode_weight < 0 or prefill_weight + decode_weight <= 0:
            raise ValueError("weights must be >= 0 and not both 0")
        self.alpha = prefill_weight / (prefill_weight + decode_weight)

    def score(
        self, req: RoutingQuery, candidates: Sequence[WorkerView], all_workers: Sequence[WorkerView]
    ) -> list[float]:
        a = self.alpha
        b = 1.0 - a
        k = self.prefill_slots
        e = self.interference_weight
        f = self.interference_floor
        g = self.itl_weight / max(req.max_tokens - 1, 1)
        prompt = req.prompt_tokens
        bs = req.block_size
        matches = req.matches
        ts: list[float] = []
        xs: list[float] = []
        ds: list[int] = []
        scale: float = 1.0
        sources = sources_of(req)
        plane = bool(req.tier_matches)
        n: float
        for w in candidates:
            if plane and w.transfer is not None:  # KV data plane: loads and pulls priced in prefill tokens
                n = plan_prefix(req, w, sources).prefill_tokens(w.transfer)
            else:
                m = matches.get(w.id, 0)
                n = prompt - m * bs if m else prompt
                if n < 0:
                    n = 0
            q = w.prefill_tokens_queued + w.inflight_prefill_tokens
            t = n + (q if k == 0 or q < k * n else k * n)
            x = g * (q - n) if q > n else 0.0
            if e:
                r = w.running - w.ended_requests
                if r < w.inflight_requests:
                    r = w.inflight_requests
                if n > f:
                    x += e * r * (n - f)
            d = w.decode_tokens_active + w.inflight_decode_tokens
            ts.append(t)
            xs.append(x)
            ds.append(d)
            scale = max(scale, t, x, d)
        inv = 1.0 / scale
        return [(a * t + x + b * d) * inv for t, x, d in zip(ts, xs, ds, strict=True)]
