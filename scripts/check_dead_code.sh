#!/usr/bin/env bash
# Dead-code check: vulture over our code (not the generated kvmesh.v1) with the reviewed whitelist.
# 60% is vulture's confidence for unused functions, classes, methods, attributes and variables (imports are 90%,
# unreachable code 100%), so this catches all of those; scripts/vulture_whitelist.py holds the false positives.
# Usage: scripts/check_dead_code.sh [PATH...]   (defaults to libs services scripts)
set -euo pipefail
cd "$(dirname "$0")/.."
(($#)) || set -- libs services scripts
exec vulture "$@" scripts/vulture_whitelist.py --exclude libs/kvmesh/v1 --min-confidence 60
