"""kvmesh cache_manager service."""
