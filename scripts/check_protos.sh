#!/usr/bin/env bash
# Proto hygiene for CI: buf lint (STANDARD), buf format, generated code up to date, no breaking change
# against the previous commit on main that has protos (BUF_AGAINST overrides the git ref).
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
cd "$root"
buf lint
buf format --diff --exit-code
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
scripts/gen_protos.sh "$tmp/v1"
if ! diff -r "$tmp/v1" libs/kvmesh/v1 >/dev/null; then
  diff -r "$tmp/v1" libs/kvmesh/v1 | head -40
  echo "generated code is stale: run 'make proto' and commit libs/kvmesh/v1" >&2
  exit 1
fi
against=${BUF_AGAINST:-HEAD~1}
if git rev-parse --verify -q "$against" >/dev/null && git cat-file -e "$against:protos/kvmesh/v1" 2>/dev/null; then
  buf breaking --against ".git#ref=$(git rev-parse "$against")"
  echo "buf breaking: no breaking change against $against"
else
  echo "buf breaking: skipped ($against has no protos yet)"
fi
echo "protos: lint, format, generated code and compatibility OK"
