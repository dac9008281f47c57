"""Generated from protos/kvmesh/v1 by scripts/gen_protos.sh. Do not edit."""
