#!/usr/bin/env bash
# Issue 8, batch 64 (~5 minutes): where the step's 1.2x of the floor goes at 64 rows. The skinny
# GEMM with its launch config swept at 64 rows (wider tiles) against cuBLAS; decode attention at
# 64 x 1,024 with its split count swept; the idle trace at batch 64 without PDL (whose
# overlapping kernels blur the per-kernel times).
#   run: RAYPAGED_COMMIT=<sha> bash scripts/gpu_rows64.sh
set -uo pipefail
source "$(dirname "$0")/gpu_setup.sh"
export RAYPAGED_PDL=1
timeout 200 python3 benchmarks/bench_gemv.py --rows 32,64 --tune-rows 64 \
    --out "$OUT_DIR/rows64" 2>&1 | grep "rows\|copy"
timeout 100 python3 benchmarks/bench_kernels.py --sections decode --decode-cases 64x1024,1x1024 \
    --tune decode --out "$OUT_DIR/attention64" 2>&1 | tail -8
RAYPAGED_PDL=0 timeout 60 python3 benchmarks/gpu_idle.py --shape 8b --batch-sizes 64 --context 1024 \
    --scheduling async --max-num-seqs 64 --max-num-batched-tokens 8192 --steps 30 \
    --out "$OUT_DIR/idle64" 2>&1 | quiet | grep -v "^{\|warn"
