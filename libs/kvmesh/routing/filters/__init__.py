"""Filters: each keeps the workers allowed to serve a request (one module per filter)."""

from kvmesh.routing.filters.circuit_closed import CircuitClosedFilter
from kvmesh.routing.filters.healthy import HealthyFilter
from kvmesh.routing.filters.kv_headroom import KvHeadroomFilter
from kvmesh.routing.filters.not_draining import NotDrainingFilter
from kvmesh.routing.filters.pool import PoolFilter

__all__ = ["CircuitClosedFilter", "HealthyFilter", "KvHeadroomFilter", "NotDrainingFilter", "PoolFilter"]
