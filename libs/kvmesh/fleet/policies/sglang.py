"""Re-implementation of SGLang's router ``cache_aware`` policy (sgl-router, Rust).

Source: sgl-project/sglang ``sgl-router/src/policies/cache_aware.rs`` and ``src/tree.rs`` (the approximate
multi-tenant radix tree), parameters as in the issue: cache_threshold 0.3, balance_abs_threshold 64,
balance_rel_threshold 1.5, max_tree_size 2^26 (tokens here; characters upstream). Per request:

    load(w) = requests the router has in flight on w (incremented when routed, decremented at completion)
    imbalanced ⇔ max load − min load > balance_abs_threshold  and  max load > balance_rel_threshold · min load
    if imbalanced: w = argmin load
    else: (k, w*) = longest prefix match of the request in the approximate tree;
          match_rate = k·bs / prompt_tokens
          w = w* if match_rate > cache_threshold else the tenant (worker) with the smallest tree
    then insert the request's blocks into the tree under w (whatever branch was taken).

The approximate tree records what the router *sent* where, not what the engines cached (no KV events); each
tenant's tree is trimmed to max_tree_size by LRU (upstream runs this in a periodic eviction thread). Ties for
the longest match go to the most recently used tenant at that depth (upstream: map iteration order).
Matching is at block granularity (upstream: character/token granularity).
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence

from kvmesh.fleet.policies.base import Policy
from kvmesh.routing.types import RoutingQuery, WorkerView


class SGLangCacheAware(Policy):
    name = "sglang"

    def __init__(
        self,
        cache_threshold: float = 0.3,
        balance_abs_threshold: int = 64,
        balance_rel_threshold: float = 1.5,
        max_tree_size: int = 2**26,
    ) -> None:
        self.cache_threshold = cache_threshold
        self.abs_t = balance_abs_threshold
        self.rel_t = balance_rel_threshold
        self.max_tree_size = max_tree_size
        self._load: dict[str, int] = {}
        self._where: dict[str, str] = {}
        self._tree: dict[str, OrderedDict[int, None]] = {}  # tenant -> blocks, LRU order
        self._owners: dict[int, dict[str, int]] = {}  # block -> tenant -> last access tick
        self._tick = 0

    def reset(self, worker_ids: Sequence[str], seed: int) -> None:
        self._load = dict.fromkeys(worker_ids, 0)
        self._where = {}
        self._tree = {w: OrderedDict() for w in worker_ids}
        self._owners = {}
        self._tick = 0

    def _match(self, hashes: Sequence[int], allowed: set[str]) -> tuple[int, str | None]:
        alive = set(allowed)
        k = 0
        best: str | None = None
        for h in hashes:
            own = self._owners.get(h)
            if not own:
                break
            nxt = alive.intersection(own)
            if not nxt:
                break
            alive = nxt
            k += 1
            best = max(alive, key=lambda t: own[t])
        return k, best

    def choose(self, req: RoutingQuery, workers: Sequence[WorkerView], now: float) -> str:
        ids = [w.id for w in workers]
        loads = [self._load.get(i, 0) for i in ids]
        lo, hi = min(loads), max(loads)
        if hi - lo > self.abs_t and hi > self.rel_t * lo:
            return ids[loads.index(lo)]
        k, best = self._match(list(req.block_hashes), set(ids))
        rate = min(k * req.block_size, req.prompt_tokens) / max(req.prompt_tokens, 1)
        if best is not None and rate > self.cache_threshold:
            return best
        sizes = [len(self._tree.get(i, ())) for i in ids]
        return ids[sizes.index(min(sizes))]

    def on_routed(self, req: RoutingQuery, worker_id: str, now: float) -> None:
        self._load[worker_id] = self._load.get(worker_id, 0) + 1
        self._where[req.request_id] = worker_id
        self._tick += 1
        tree = self._tree.setdefault(worker_id, OrderedDict())
        for h in req.block_hashes:
            tree[h] = None
            tree.move_to_end(h)
            self._owners.setdefault(h, {})[worker_id] = self._tick
        limit = max(1, self.max_tree_size // req.block_size)
        while len(tree) > limit:
            h, _ = tree.popitem(last=False)
            own = self._owners.get(h)
            if own is not None:
                own.pop(worker_id, None)
                if not own:
                    del self._owners[h]

    def on_finish(self, request_id: str, worker_id: str, now: float) -> None:
        w = self._where.pop(request_id, None)
        if w is not None:
            self._load[w] -= 1
