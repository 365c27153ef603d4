#!/usr/bin/env bash
# Issue 8, decode at batch 1 (~7 minutes): the step is 97% kernels (scripts/gpu_idle.sh), of which
# cuBLAS runs the 8B's qkv / o projections at ~3.1 TB/s and attention at 1k context takes 0.41 ms.
#   1. the skinny-GEMM kernel's GPU tests (bf16, 8B shapes);
#   2. benchmarks/bench_gemv.py: its launch-config sweep and each shape against cuBLAS;
#   3. decode attention at short contexts (1 and 8 sequences of 1,024 tokens) with the split
#      count swept (bench_kernels --tune decode), into $OUT/short_context/;
#   4. the engine's decode step at batch 1 and 64, async scheduling, in process.
#   run: RAYPAGED_COMMIT=<sha> bash scripts/gpu_gemv.sh
set -uo pipefail
source "$(dirname "$0")/gpu_setup.sh"
timeout 120 python3 -m pytest tests/test_kernels_gemv.py -m gpu -q -p no:cacheprovider 2>&1 | tail -3
timeout 270 python3 benchmarks/bench_gemv.py --out "$OUT_DIR" 2>&1 | tee "$OUT_DIR/gemv.log" | grep -v "best {"
timeout 100 python3 benchmarks/bench_kernels.py --sections decode --decode-cases 1x1024,8x1024 \
    --tune decode --out "$OUT_DIR/short_context" 2>&1 | tail -8
timeout 150 python3 benchmarks/bench_engine.py --shape 8b --executors uni --scheduling async \
    --batch-sizes 1,64 --context 1024 --decode-steps 30 --throughput-batch 128 --prompt-len 512 \
    --output-len 256 --out "$OUT_DIR" 2>&1 | quiet | grep -v "^{"
