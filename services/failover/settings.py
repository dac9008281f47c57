"""Settings of the failover service (flags and KVMESH_* env, see kvmesh.config)."""

from __future__ import annotations

from dataclasses import dataclass

from kvmesh.config import ServerSettings, setting


@dataclass(frozen=True)
class FailoverSettings(ServerSettings):
    """kvmesh failover: discovery, zone health and traffic weights."""

    lkg_file: str = setting("", "where the last known good endpoint sets are persisted")
    health_interval_s: float = setting(1.0, "seconds between health evaluations")
