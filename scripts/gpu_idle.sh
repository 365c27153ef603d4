#!/usr/bin/env bash
# Issue 8's decode target (~3 minutes): is the 8B decode step's distance from the byte floor
# kernel time or GPU idle time? benchmarks/gpu_idle.py traces 20 steps per case with
# torch.profiler: wall vs the GPU's kernel time per step, sync and async, and the top kernels
# (at 2aa12b5: 97-98% busy with async scheduling, so kernels; benchmarks/README.md).
#   run: RAYPAGED_COMMIT=<sha> bash scripts/gpu_idle.sh
set -uo pipefail
source "$(dirname "$0")/gpu_setup.sh"
timeout 400 python3 benchmarks/gpu_idle.py --shape 8b --batch-sizes 1,64 --context 1024 \
    --out "$OUT_DIR" 2>&1 | quiet | tee "$OUT_DIR/gpu_idle.log"
