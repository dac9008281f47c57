"""kvmesh client library: follows the failover service's endpoint sets, picks a router by weight,
retries before the first token and resumes broken streams (`AsyncClient`, `Client`); `mesh` gives a
plain gRPC service-config channel for clients that only know a DNS name. Every entry point takes
`security=ChannelSecurity(tls_ca, tls_client_cert, tls_client_key)` for TLS / mTLS to the services;
`AsyncClient` / `Client` also send its `token` (a client identity's bearer token, docs/security.md) on every
call, the `mesh` channels only their TLS."""

from kvmesh.client.aio import AsyncClient
from kvmesh.client.endpoints import EndpointSet
from kvmesh.client.mesh import mesh_aio_channel, mesh_channel, service_config
from kvmesh.client.sync import Client
from kvmesh.client.watch import EndpointWatcher
from kvmesh.rpc.channel import ChannelSecurity

__all__ = [
    "AsyncClient",
    "ChannelSecurity",
    "Client",
    "EndpointSet",
    "EndpointWatcher",
    "mesh_aio_channel",
    "mesh_channel",
    "service_config",
]
