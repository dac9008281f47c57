"""kvmesh.routing — pure routing policy: filters → scorers → picker, configured from YAML.

No I/O, no clock, no threads: time enters as `now` arguments, so the same code runs in the router service
and inside a discrete-event simulator.

API
---
    from kvmesh.routing import Profile, RoutingQuery, WorkerView, InflightTracker

    profile = Profile.default(seed=1)                 # or Profile.from_yaml(text), Profile.baseline("random")
    views = [WorkerView(id="w0", kv_blocks_total=4096), ...]   # apply_report(LoadReport) keeps them fresh
    tracker = InflightTracker()
    req = RoutingQuery("req-1", prompt_tokens=1200, block_hashes=hashes, matches=index.find_matches(hashes),
                       block_size=16, session_id="s-9", max_tokens=256)
    tracker.apply(views)                              # router's own in-flight work into the views
    d = profile.decide(req, views)                    # Decision: worker_id (None → d.rejected_by), terms
    if d.worker_id is not None:
        tracker.assign(req.request_id, d.worker_id, req.prompt_tokens - req.overlap_tokens(d.worker_id),
                       req.prompt_tokens, req.block_size, now)
    ...  tracker.first_token(rid); tracker.finish(rid); tracker.on_report(worker, report.timestamp)
    profile.set_weights(prefill_weight=0.7, decode_weight=0.3)   # next decide() uses alpha = 0.7

Parts (each module's docstring states its formula)
--------------------------------------------------
- filters: `healthy`, `not-draining`, `circuit-closed`, `kv-headroom` (≤ 95 % KV after the request),
  `pool` (long/short prompts).
- scorers (every one returns a cost, lower is better): `cost` (default, alpha·prefill + (1-alpha)·decode on a
  shared token scale), `prefill-cost`, `decode-load`, `decode-capability`, `node-health`,
  `session-affinity` (consistent-hash ring, `ring.HashRing`).
- pickers: `min-cost` (ε-band + power-of-two-choices on in-flight counts: no herding), baselines
  `round-robin`, `random`, `least-loaded`.
- `circuit.CircuitBreaker` (p95 > 1200 ms or errors > 1 % → open → half-open probes → closed),
  `admission.Admission` (long/short queues, RESOURCE_EXHAUSTED with retry-after),
  `inflight.InflightTracker` (own assignments between load reports),
  `attempts` (after each attempt of a request: done, retry, migrate or fail, and what the breaker records).

Custom plugins: decorate a class with `@register(FILTERS|SCORERS|PICKERS, "type-name")` from
`kvmesh.routing.plugin` and name it in YAML.
"""

from kvmesh.routing.admission import Admission, QueueLimits
from kvmesh.routing.circuit import BreakerConfig, CircuitBreaker
from kvmesh.routing.inflight import InflightTracker
from kvmesh.routing.plugin import FILTERS, PICKERS, SCORERS, Filter, Picker, Scorer, register
from kvmesh.routing.profile import BASELINES, Profile
from kvmesh.routing.ring import HashRing
from kvmesh.routing.types import CircuitState, Decision, RoutingQuery, WorkerView

__all__ = [
    "BASELINES",
    "FILTERS",
    "PICKERS",
    "SCORERS",
    "Admission",
    "BreakerConfig",
    "CircuitBreaker",
    "CircuitState",
    "Decision",
    "Filter",
    "HashRing",
    "InflightTracker",
    "Picker",
    "Profile",
    "QueueLimits",
    "RoutingQuery",
    "Scorer",
    "WorkerView",
    "register",
]
