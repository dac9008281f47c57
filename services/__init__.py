"""The four kvmesh services (imported as `kvmesh.services.<name>`). Each is thin wiring over `kvmesh` libs."""
