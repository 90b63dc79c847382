#!/usr/bin/env bash
# Installs the peers benchmarks/edge.py measures KDN's edge against, into the repo's .peers/ (gitignored):
#   .peers/lmcache-venv  LMCache 0.5.6 (lmcache_server + LMCServerConnector) with torch 2.13.0, in its own venv
#   .peers/redis         redis-server 7.0 extracted from the .deb files in the apt cache (no root install)
# Idempotent: each step checks whether it is already done and says what it did.
#     bash benchmarks/peers/install.sh
set -euo pipefail
REPO="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"
PEERS="$REPO/.peers"
VENV="$PEERS/lmcache-venv"
REDIS="$PEERS/redis"
DEBS="${KDN_PEERS_DEBS:-/var/cache/apt/archives}"
mkdir -p "$PEERS"

say() { printf '[peers] %s\n' "$*"; }

# -- LMCache ------------------------------------------------------------------------------------
# lmcache's declared requirements pull CUDA builds and pinned vLLM pieces; the server and its
# remote connector need only torch and the light deps below, so it goes in with --no-deps.
LIGHT_DEPS=("numpy<=2.2.6" pyyaml msgspec psutil py-cpuinfo "prometheus_client<=0.24.1" sortedcontainers
  aiofile aiofiles blake3 "pyzmq>=25" redis safetensors cachetools aiohttp fastapi uvicorn httpx httptools
  numba nvtx requests "transformers>=5.4" cryptography opentelemetry-sdk opentelemetry-exporter-prometheus
  setuptools_scm matplotlib)
if [ ! -x "$VENV/bin/python" ]; then
  python3 -m venv "$VENV"
  say "created venv $VENV"
else
  say "venv $VENV exists"
fi
PIP=("$VENV/bin/python" -m pip)
if "$VENV/bin/python" -c "import torch, sys; sys.exit(torch.__version__.split('+')[0] != '2.13.0')" 2>/dev/null; then
  say "torch 2.13.0 already installed"
else
  "${PIP[@]}" install -q "torch==2.13.0"
  say "installed torch 2.13.0"
fi
if "$VENV/bin/python" -c "import importlib.metadata as m, sys; sys.exit(m.version('lmcache') != '0.5.6')" 2>/dev/null; then
  say "lmcache 0.5.6 already installed"
else
  "${PIP[@]}" install -q --no-deps "lmcache==0.5.6"
  say "installed lmcache 0.5.6 (--no-deps)"
fi
missing=()
# all at once (one resolver run); one by one only when that fails, to name what the index lacks
if "${PIP[@]}" install "${LIGHT_DEPS[@]}" >"$PEERS/pip-out.txt" 2>&1; then :; else
  for dep in "${LIGHT_DEPS[@]}"; do
    if ! "${PIP[@]}" install "$dep" >>"$PEERS/pip-out.txt" 2>&1; then
      missing+=("$dep"); say "could not install $dep: $(tail -n 1 "$PEERS/pip-out.txt")"
    fi
  done
fi
if grep -q "Successfully installed" "$PEERS/pip-out.txt"; then
  say "light deps: $(grep "Successfully installed" "$PEERS/pip-out.txt" | tail -n 1 | wc -w | awk '{print $1 - 2}') packages installed"
else
  say "light deps already installed"
fi
[ ${#missing[@]} -eq 0 ] || say "light deps missing: ${missing[*]}"
rm -f "$PEERS/pip-out.txt"
if "$VENV/bin/python" -c "from lmcache.v1.storage_backend.connector.lm_connector import LMCServerConnector" 2>"$PEERS/import-err.txt"; then
  say "lmcache imports: LMCServerConnector OK"
else
  say "lmcache import FAILED: $(tail -n 1 "$PEERS/import-err.txt")"
fi
rm -f "$PEERS/import-err.txt"

# -- Redis ----------------------------------------------------------------------------------------
if [ -x "$REDIS/usr/bin/redis-server" ]; then
  say "redis-server already extracted in $REDIS"
else
  mkdir -p "$REDIS"
  for pkg in redis-server redis-tools libjemalloc2 liblzf1 libhiredis0.14; do
    deb=$(ls "$DEBS"/"${pkg}"_*.deb 2>/dev/null | head -n 1 || true)
    if [ -z "$deb" ]; then say "no .deb for $pkg in $DEBS"; exit 1; fi
    dpkg-deb -x "$deb" "$REDIS"
    say "extracted $(basename "$deb")"
  done
fi
LIBS="$REDIS/usr/lib/x86_64-linux-gnu"
if LD_LIBRARY_PATH="$LIBS" "$REDIS/usr/bin/redis-server" --version >/dev/null; then
  say "redis-server runs: $(LD_LIBRARY_PATH="$LIBS" "$REDIS/usr/bin/redis-server" --version | cut -d' ' -f1-3)"
fi
