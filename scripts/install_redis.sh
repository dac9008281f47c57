#!/usr/bin/env bash
# Install redis-server (Debian/Ubuntu) if it is not already on PATH. Idempotent: a second run is a no-op.
set -euo pipefail

if command -v redis-server >/dev/null 2>&1; then
  echo "redis-server already installed: $(command -v redis-server)"
  exit 0
fi

SUDO=""
if [ "$(id -u)" -ne 0 ]; then
  if command -v sudo >/dev/null 2>&1; then SUDO="sudo"; else
    echo "install_redis.sh: need root or sudo to apt-get install redis-server" >&2; exit 1
  fi
fi

export DEBIAN_FRONTEND=noninteractive
$SUDO apt-get update -y
$SUDO apt-get install -y --no-install-recommends redis-server
# The package may start a system-wide instance; kvmesh tests start their own on a free port.
command -v redis-server >/dev/null 2>&1 || { echo "redis-server still missing after install" >&2; exit 1; }
echo "redis-server installed: $(command -v redis-server)"
