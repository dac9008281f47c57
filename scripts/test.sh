#!/usr/bin/env bash
# The test command (README, second command; .ci/run calls exactly this):
# install what is missing, then lint, type-check, proto checks and the whole pytest suite.
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
cd "$root"
scripts/bootstrap.sh
export PATH="$root/.venv/bin:$PATH" HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 KVMESH_REQUIRE_NATIVE=1
echo "== ruff"; ruff check . && ruff format --check .
echo "== boundaries"; python scripts/check_boundaries.py
echo "== dead code"; scripts/check_dead_code.sh
echo "== mypy"; mypy libs services
echo "== protos"; scripts/check_protos.sh
echo "== pytest"; python -m pytest -p no:cacheprovider "$@"
