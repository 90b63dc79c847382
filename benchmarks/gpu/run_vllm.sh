#!/usr/bin/env bash
# The vLLM connector tests and TTFT benchmark on a CUDA host, in one go (target: under 10 minutes
# once the wheels are in the pip cache or a local index).
#
#   benchmarks/gpu/run_vllm.sh            # from anywhere; writes benchmarks/results/gpu-vllm/
#
# UNTESTED: no GPU was available when this was written. What it relies on:
# - the connector reads the paged KV layout from the tensors vLLM registers (the standardized
#   logical [blocks, H, block, 2*D] view, whatever the backend's physical strides), so the CPU
#   code path is the CUDA one, except that copies are ordered against the compute stream with
#   CUDA events (kdn/integrations/vllm/paged.py PagedCache.place, load.py LoadJob.wait_layer);
# - vLLM's own connector beside KDN on a GPU is the CPU-offloading OffloadingConnector
#   (benchmarks/vllm_ttft.py picks it when CUDA is available).
set -euo pipefail
cd "$(dirname "$0")/../.."
OUT=benchmarks/results/gpu-vllm
mkdir -p "$OUT"
VENV=.venv-gpu
T0=$(date +%s)
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv | tee "$OUT/gpu.txt"
if [ ! -x "$VENV/bin/vllm" ]; then
  # the CUDA wheel of the same vLLM release; it brings the torch it was built for
  KDN_VLLM_PACKAGE="${KDN_VLLM_PACKAGE:-vllm==0.32.0}" deploy/install-vllm.sh "$VENV" 2>&1 | tail -5
fi
echo "install: $(( $(date +%s) - T0 )) s" | tee "$OUT/timing.txt"
# connector cases: one engine, every case (same greedy tokens, tenants, faults, origin agreement)
KDN_REQUIRE_VLLM=1 timeout 300 "$VENV/bin/python" -m pytest -q -m vllm tests/vllm -x 2>&1 | tee "$OUT/tests.txt" | tail -15
echo "tests done: $(( $(date +%s) - T0 )) s" | tee -a "$OUT/timing.txt"
# TTFT: 3 rounds keep it inside the budget; results land in $OUT, BENCHMARKS.md is not touched
timeout 420 "$VENV/bin/python" benchmarks/vllm_ttft.py --dtype bfloat16 --rounds 3 --contexts 1024 4096 --no-append --out "$OUT" \
  2>"$OUT/bench.stderr" | tee "$OUT/bench.json"
echo "total: $(( $(date +%s) - T0 )) s" | tee -a "$OUT/timing.txt"
