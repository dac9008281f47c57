"""Where a matched prefix lives on a worker: its leading GPU run and the rest, held only in host tiers.

For a worker w holding the `matched` leading blocks h_0 … h_{m-1} of a prompt, and T(w) the set of index
hashes w holds *only* in a host tier (CPU/disk, not on its GPU):

    gpu_run(w) = min{ i < m : h_i ∈ T(w) } (m if none)       blocks served from the GPU pool as they are
    tier(w)    = m − gpu_run(w)                              blocks past that run, loadable from w's tiers

(a block past the first tier-only one counts as tier even when it is on the GPU: the engine uses a prefix
hit only up to its first miss). One function for the cache-manager (`Ingestor.gpu_run`, FindMatches'
`tier_blocks`) and the router's index replica (from WatchIndex's `tier_only` / `on_gpu` deltas).
"""

from __future__ import annotations

from collections.abc import Collection, Mapping, Sequence
from dataclasses import dataclass, field

import numpy as np
import numpy.typing as npt

Hashes = Sequence[int] | npt.NDArray[np.uint64]


def gpu_run(hashes: Hashes, matched: int, tier_only: Collection[int]) -> int:
    """How many of the `matched` leading `hashes` are on the GPU before the first tier-only one."""
    if not tier_only:
        return matched
    for i in range(matched):
        if int(hashes[i]) in tier_only:
            return i
    return matched


def split_matches(
    hashes: Hashes, matches: Mapping[str, int], tier_only: Mapping[str, Collection[int]]
) -> dict[str, int]:
    """{worker: gpu_run} for every worker of `matches` (its total, GPU + tier, stays `matches[w]`)."""
    return {w: gpu_run(hashes, m, tier_only.get(w, ())) for w, m in matches.items()}


@dataclass(frozen=True, slots=True)
class PrefixMatches:
    """A prompt's matches per worker: `total[w]` leading blocks held (GPU or host tier), `gpu[w]` ≤ total[w]
    of them in w's leading GPU run (:func:`gpu_run`)."""

    gpu: dict[str, int] = field(default_factory=dict)
    total: dict[str, int] = field(default_factory=dict)
