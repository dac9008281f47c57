"""Routing policies compared by the fleet simulator; :func:`make_policy` builds one by name."""

from __future__ import annotations

from kvmesh.fleet.policies.base import Policy
from kvmesh.fleet.policies.dynamo import Dynamo
from kvmesh.fleet.policies.llm_d import LlmD
from kvmesh.fleet.policies.oracle import MaxOverlap
from kvmesh.fleet.policies.profile import ProfilePolicy, baseline_policy, kvmesh_policy
from kvmesh.fleet.policies.session import SessionAffinity
from kvmesh.fleet.policies.sglang import SGLangCacheAware

ALL_POLICIES = ("kvmesh", "round_robin", "random", "least_loaded", "session", "dynamo", "sglang", "llm_d")


def make_policy(name: str, kvmesh_profile: str | None = None) -> Policy:
    """A fresh policy object for ``name`` (one of :data:`ALL_POLICIES`, or the reference ``max_overlap``)."""
    if name == "kvmesh":
        return kvmesh_policy(kvmesh_profile)
    if name in ("round_robin", "random", "least_loaded"):
        return baseline_policy(name)
    if name == "session":
        return SessionAffinity()
    if name == "dynamo":
        return Dynamo()
    if name == "sglang":
        return SGLangCacheAware()
    if name == "llm_d":
        return LlmD()
    if name == "max_overlap":
        return MaxOverlap()
    raise ValueError(f"unknown policy {name!r}; known: {', '.join(ALL_POLICIES)}")


__all__ = ["ALL_POLICIES", "Policy", "ProfilePolicy", "make_policy"]
