#!/usr/bin/env bash
# The vLLM connector's block copies and tier copy paths on a GPU, checked against CPU copies, and the host <->
# device copy rates (pinned, pageable) against the device's own copy rate: one JSON line, exit status 1 when a
# check failed (libs/kvmesh/kvplane/vllm_connector/device_check.py says what each check does).
# Needs python3 with PyTorch (and numpy) only: no vLLM, no package registry, no venv. Without a GPU it runs the
# same checks on CPU tensors (a self-test). Bounded to 10 minutes.
#   scripts/device_check.sh [--device auto|cuda|cuda:N|cpu] [--mib N] [--repeats N]
#   PYTHON=.venv/bin/python scripts/device_check.sh --device cpu   # the self-test, with the venv's python
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
cd "$root"
exec timeout 600 env PYTHONPATH="libs${PYTHONPATH:+:$PYTHONPATH}" "${PYTHON:-python3}" \
  -m kvmesh.kvplane.vllm_connector.device_check "$@"
