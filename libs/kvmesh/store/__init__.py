"""Checkpoint stores: a snapshot plus an append-only log of records after it (file or Redis)."""

from kvmesh.store.base import CheckpointStore, Loaded
from kvmesh.store.file import FileCheckpointStore

__all__ = ["CheckpointStore", "FileCheckpointStore", "Loaded"]
