"""kvmesh failover service."""
