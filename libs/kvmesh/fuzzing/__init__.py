"""Fuzz cases for kvmesh's gRPC and HTTP surfaces (pure `hypothesis` strategies; the runner that sends them
to running services is `kvmesh.bench.fuzz`)."""
