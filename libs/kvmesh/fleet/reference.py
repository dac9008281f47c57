"""Reference hit ratios of a trace, independent of routing.

* :func:`pooled_lru_hit_ratio` — one LRU cache holding the whole fleet's KV capacity (``capacity_blocks``),
  fed the requests in arrival order: a request hits the leading run of its full blocks present in the cache,
  then all its full blocks become most recently used (missing ones inserted, evicting the least recently
  used). Ratio = Σ hit blocks · block_size (capped at the prompt length) / Σ prompt tokens — the same
  token-weighted definition as the simulator's ``hit_ratio``.
* :func:`ideal_hit_ratio` — the same with an unbounded cache.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence

import numpy as np


def pooled_lru_hit_ratio(
    prompts: Sequence[tuple[int, np.ndarray]], block_size: int, capacity_blocks: int | None
) -> float:
    """``prompts``: (prompt_tokens, full-block hashes) in arrival order; ``None`` capacity = unbounded."""
    lru: OrderedDict[int, None] = OrderedDict()
    hit_tokens = total = 0
    for n_tokens, hashes in prompts:
        total += n_tokens
        k = 0
        hs = hashes.tolist()
        while k < len(hs) and hs[k] in lru:
            k += 1
        hit_tokens += min(k * block_size, n_tokens)
        for h in hs:
            if h in lru:
                lru.move_to_end(h)
            else:
                lru[h] = None
        if capacity_blocks is not None:
            while len(lru) > capacity_blocks:
                lru.popitem(last=False)
    return hit_tokens / max(total, 1)


def ideal_hit_ratio(prompts: Sequence[tuple[int, np.ndarray]], block_size: int) -> float:
    """Hit ratio of an infinite cache (every block computed once)."""
    return pooled_lru_hit_ratio(prompts, block_size, None)
