#!/usr/bin/env bash
# Issue 8's decode target with the skinny GEMM (silu fused into the down projection) and the
# short-context split change (~5 minutes, each part under a timeout, 430 s in all):
#   1. GPU tests: the GEMM kernel (bf16, 8B shapes) and the engine against transformers in fp32
#      (CUDA graphs on/off x async on/off), which runs the skinny GEMM;
#   2. the engine's decode step at batch 1, 8, 64, 256 (context 1,024), async, in process;
#   3. benchmarks/bench_gemv.py without its sweep: every linear, default config vs cuBLAS.
#   run: RAYPAGED_COMMIT=<sha> bash scripts/gpu_decode.sh
set -uo pipefail
source "$(dirname "$0")/gpu_setup.sh"
timeout 170 python3 -m pytest -q -m gpu -p no:cacheprovider tests/test_kernels_gemv.py \
    tests/test_engine_generate.py 2>&1 | tail -4 | tee "$OUT_DIR/gpu_tests_decode.log"
timeout 170 python3 benchmarks/bench_engine.py --shape 8b --executors uni --scheduling async \
    --batch-sizes 1,8,64,256 --context 1024 --decode-steps 30 --throughput-batch 128 --prompt-len 512 \
    --output-len 256 --out "$OUT_DIR" 2>&1 | quiet | grep -v "^{"
timeout 90 python3 benchmarks/bench_gemv.py --tune-rows "" --rows 1,8,16 --out "$OUT_DIR" 2>&1 \
    | tee "$OUT_DIR/gemv.log" | grep -v "best {"
