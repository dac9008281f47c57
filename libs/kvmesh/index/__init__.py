"""Prefix index: which worker holds which KV block (pure; see :mod:`kvmesh.index.prefix_index`)."""

from kvmesh.index.prefix_index import PrefixIndex

__all__ = ["PrefixIndex"]
