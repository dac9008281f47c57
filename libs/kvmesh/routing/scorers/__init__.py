"""Scorers: each returns one cost per candidate, lower is better (one module per scorer)."""

from kvmesh.routing.scorers.cost import CostScorer
from kvmesh.routing.scorers.decode_capability import DecodeCapabilityScorer
from kvmesh.routing.scorers.decode_load import DecodeLoadScorer, decode_tokens
from kvmesh.routing.scorers.node_health import NodeHealthScorer
from kvmesh.routing.scorers.prefill_cost import PrefillCostScorer, prefill_tokens
from kvmesh.routing.scorers.session_affinity import SessionAffinityScorer

__all__ = [
    "CostScorer",
    "DecodeCapabilityScorer",
    "DecodeLoadScorer",
    "NodeHealthScorer",
    "PrefillCostScorer",
    "SessionAffinityScorer",
    "decode_tokens",
    "prefill_tokens",
]
