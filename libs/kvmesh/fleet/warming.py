"""Warming strategies in the fleet simulator, driving the real ``kvmesh.ops.warming`` decisions.

* none: nothing is preloaded.
* static: at t = 0 the configured templates (the most common ~30 % of prefixes; for a tenant workload, the
  system prompts of the most frequent tenants) are prefilled on ``replicas`` workers each
  (``kvmesh.ops.warming.decide.plan_static``), as prefill-only requests that take real engine time.
* dynamic: every arrival is counted in ``kvmesh.ops.warming.stats.PrefixStats`` (60 s window); every
  ``interval_s`` of virtual time ``plan_dynamic`` warms each prefix seen ≥ 5 times a minute onto
  ``target = min(max_replicas, 1 + ⌊rate/5⌋)`` workers (least loaded first), subject to the hybrid LFU+LRU
  warm set (``HybridWarmSet``, capacity ``warm_fraction`` of the fleet's KV blocks). Holders of a prefix are
  read from the simulated cache-manager index.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence
from typing import TYPE_CHECKING, cast

import numpy as np

from kvmesh.fleet.trace import Trace, chunk_tokens
from kvmesh.ops.warming.decide import WarmingConfig, plan_dynamic, plan_static
from kvmesh.ops.warming.policy import HybridWarmSet
from kvmesh.ops.warming.stats import PrefixInfo, PrefixStats
from kvmesh.ops.warming.templates import Template

if TYPE_CHECKING:
    from kvmesh.fleet.sim import FleetSim


def tenant_templates(
    trace: Trace, sys_chunks: int, fraction: float = 0.3, replicas: int = 2, vocab_size: int = 128_256
) -> list[Template]:
    """Templates = the first ``sys_chunks`` chunks of the most frequent ``fraction`` of tenants."""
    counts = Counter(r.tenant for r in trace if r.tenant is not None)
    first = {}
    for r in trace:
        if r.tenant is not None and r.tenant not in first:
            first[r.tenant] = r.chunks[:sys_chunks]
    top = [t for t, _ in counts.most_common(max(1, round(fraction * len(counts))))]
    return [Template(t, tuple(chunk_tokens(first[t], vocab_size).tolist()), replicas) for t in top]


def _loads(sim: FleetSim) -> dict[str, float]:
    return {v.id: v.kv_usage for v in sim.views()}


class StaticWarming:
    """Preload templates at start (see module docstring)."""

    name = "static"

    def __init__(self, templates: list[Template]) -> None:
        self.templates = templates

    def start(self, sim: FleetSim, now: float) -> None:
        queued: Counter[str] = Counter()
        for t in self.templates:
            loads = {w: float(queued[w]) for w in sim.ids}
            plan = plan_static([t], loads, lambda _t: set())
            for a in plan.actions:
                sim.submit_warm(sim.slot[a.worker], np.asarray(a.token_ids, dtype=np.int64))
                queued[a.worker] += len(a.token_ids)

    def on_arrival(self, sim: FleetSim, hashes: np.ndarray, tokens: np.ndarray, now: float) -> None:
        return None


class DynamicWarming:
    """Warm hot prefixes onto more workers at run time (see module docstring)."""

    name = "dynamic"

    def __init__(
        self, cfg: WarmingConfig = WarmingConfig(), interval_s: float = 5.0, warm_fraction: float = 0.3
    ) -> None:
        self.cfg = cfg
        self.interval_s = interval_s
        self.warm_fraction = warm_fraction
        self.stats = PrefixStats(window_s=cfg.window_s)
        self.warm: HybridWarmSet | None = None
        self._next = 0.0
        self.actions = 0

    def start(self, sim: FleetSim, now: float) -> None:
        total = sum(e.pool.num_blocks for e in sim.engines)
        self.warm = HybridWarmSet(max(1, int(self.warm_fraction * total)))
        self._next = now + self.interval_s

    def on_arrival(self, sim: FleetSim, hashes: np.ndarray, tokens: np.ndarray, now: float) -> None:
        bs = sim.cfg.block_size
        # PrefixStats keeps tuple(tokens[:n·bs]) of new keys; a numpy slice is converted only then
        self.stats.observe(hashes.tolist(), now, cast("Sequence[int]", tokens), bs)
        if now < self._next or self.warm is None:
            return
        self._next = now + self.interval_s

        def holders(key: int, inf: PrefixInfo) -> set[str]:
            toks = np.asarray(inf.token_ids or (), dtype=np.int64)
            hs = sim.hc_hashes_of(toks)
            m = sim.index.find_matches(hs) if len(hs) else {}
            return {w for w, k in m.items() if k >= inf.n_blocks}

        plan = plan_dynamic(self.stats, now, _loads(sim), holders, self.warm, self.cfg)
        for a in plan.actions:
            if sim.submit_warm(sim.slot[a.worker], np.asarray(a.token_ids, dtype=np.int64)):
                self.actions += 1
