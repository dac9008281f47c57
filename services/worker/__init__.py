"""kvmesh worker service."""
