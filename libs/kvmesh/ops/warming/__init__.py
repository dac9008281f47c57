"""Prefix statistics, static templates, dynamic warming decisions and the LFU+LRU warm-set policy (pure)."""

from kvmesh.ops.warming.decide import WarmAction, WarmingConfig, plan_dynamic, plan_static
from kvmesh.ops.warming.policy import HybridWarmSet
from kvmesh.ops.warming.stats import PrefixStats, checkpoints
from kvmesh.ops.warming.templates import Template, load_templates

__all__ = [
    "HybridWarmSet",
    "PrefixStats",
    "Template",
    "WarmAction",
    "WarmingConfig",
    "checkpoints",
    "load_templates",
    "plan_dynamic",
    "plan_static",
]
