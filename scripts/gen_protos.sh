#!/usr/bin/env bash
# Regenerates the generated-only package libs/kvmesh/v1/ from protos/kvmesh/v1/*.proto
# (grpcio-tools: protoc + gRPC plugin; mypy-protobuf: .pyi stubs). Never edit the output by hand.
# Usage: scripts/gen_protos.sh [OUT_DIR]   (default libs/kvmesh/v1; the CI check generates elsewhere and diffs)
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
out=${1:-"$root/libs/kvmesh/v1"}
py=${PYTHON:-python}
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
"$py" -m grpc_tools.protoc -I "$root/protos" \
  --python_out="$tmp" --grpc_python_out="$tmp" --mypy_out=quiet:"$tmp" --mypy_grpc_out=quiet:"$tmp" \
  "$root"/protos/kvmesh/v1/*.proto
rm -rf "$out"
mkdir -p "$out"
cp "$tmp"/kvmesh/v1/* "$out"/
printf '"""Generated from protos/kvmesh/v1 by scripts/gen_protos.sh. Do not edit."""\n' > "$out/__init__.py"
