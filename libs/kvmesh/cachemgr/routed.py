"""The routed-prefix report (`CacheManagerService/ReportRoutedPrefixes`): its bounds and the check the
cache-manager makes before counting a batch.

A router that routes from a fresh index replica never asks FindMatches, so it reports each routed prompt
instead, in the compact form the prefix statistics need: its block count, the index hashes at its checkpoints
(`kvmesh.ops.warming.stats.checkpoint_keys`: ⌈log₂ n⌉ + 1 hashes for n blocks), the best worker's match, the
tenant and, optionally, its leading token ids (kept for warming and replication). The whole batch is checked
before any of it is counted.
"""

from __future__ import annotations

from kvmesh.ops.warming.stats import checkpoints
from kvmesh.rpc.validate import max_len, require
from kvmesh.v1 import cache_manager_pb2 as pb

MAX_ROUTED_PREFIXES = 1024  # entries per ReportRoutedPrefixes request
MAX_ROUTED_BLOCKS = 1 << 20  # blocks per entry (so at most 21 checkpoint hashes)
MAX_ROUTED_TOKENS = 131_072  # token ids per entry


def validate_report(request: pb.ReportRoutedPrefixesRequest) -> None:
    """Raises InvalidArgument naming the first field out of bounds (nothing is counted then)."""
    max_len(request.prefixes, "prefixes", MAX_ROUTED_PREFIXES)
    for i, p in enumerate(request.prefixes):
        require(1 <= p.blocks <= MAX_ROUTED_BLOCKS, f"prefixes[{i}].blocks", f"must be in [1, {MAX_ROUTED_BLOCKS}]")
        want = len(checkpoints(p.blocks))
        require(
            len(p.checkpoint_hashes) == want,
            f"prefixes[{i}].checkpoint_hashes",
            f"{p.blocks} blocks have {want} checkpoint hashes, got {len(p.checkpoint_hashes)}",
        )
        require(p.hit_blocks <= p.blocks, f"prefixes[{i}].hit_blocks", f"must be at most blocks ({p.blocks})")
        max_len(p.token_ids, f"prefixes[{i}].token_ids", MAX_ROUTED_TOKENS)
