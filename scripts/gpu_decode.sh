#!/usr/bin/env bash
# Issue 8's decode figures at the current tree (~6 minutes, each part under a timeout, 520 s in
# all): with PDL on (the default) and the H200's tuned GEMM table,
#   1. every GPU test (-m gpu: kernels bf16 at the 8B's shapes, PDL on/off bit for bit, the
#      engine against transformers in fp32 with CUDA graphs and async scheduling on/off);
#   2. the engine's decode step at batch 1, 8, 64, 256 (context 1,024), async, in process, and
#      its offline throughput at 128 x (512 + 256);
#   3. benchmarks/bench_gemv.py without its sweep: every linear at 1, 16, 64 rows as ops.linear
#      launches it, against cuBLAS.
#   run: RAYPAGED_COMMIT=<sha> bash scripts/gpu_decode.sh
set -uo pipefail
source "$(dirname "$0")/gpu_setup.sh"
# The GPU tests' files (collecting the whole suite would import Ray, which the GPU machine lacks).
timeout 250 python3 -m pytest -q -m gpu -p no:cacheprovider $(grep -l "mark.gpu" tests/test_*.py) 2>&1 | tail -4 \
    | tee "$OUT_DIR/gpu_tests_decode.log"
timeout 180 python3 benchmarks/bench_engine.py --shape 8b --executors uni --scheduling async \
    --batch-sizes 1,8,64,256 --context 1024 --decode-steps 50 --throughput-batch 128 --prompt-len 512 \
    --output-len 256 --out "$OUT_DIR" 2>&1 | quiet | grep -v "^{"
timeout 90 python3 benchmarks/bench_gemv.py --tune-rows "" --rows 1,16,64 --out "$OUT_DIR" 2>&1 \
    | tee "$OUT_DIR/gemv.log" | grep -v "best {"
