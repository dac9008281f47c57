"""The five kvmesh services, imported as `kvmesh.services.<name>`: router, cache_manager, worker, failover and planner.
Each is thin wiring over `kvmesh` libs."""
