#!/usr/bin/env bash
# Issue 8's decode target after the skinny GEMM and the short-context split change (~7 minutes):
#   1. GPU tests: the GEMM kernel (bf16, 8B shapes), decode attention, and the engine against
#      transformers in fp32 (CUDA graphs on/off x async on/off), which now runs the skinny GEMM;
#   2. decode attention at 1 and 8 sequences of 1,024 tokens, splits and tiles swept;
#   3. the engine's decode step at batch 1, 8, 64, 256 (context 1,024), sync and async, in process;
#   4. scripts/gpu_idle.sh's trace (GPU busy vs wall, top kernels), async only.
#   run: RAYPAGED_COMMIT=<sha> bash scripts/gpu_decode.sh
set -uo pipefail
source "$(dirname "$0")/gpu_setup.sh"
timeout 200 python3 -m pytest -q -m gpu -p no:cacheprovider tests/test_kernels_gemv.py \
    tests/test_engine_generate.py "tests/test_kernels_triton.py::test_gpu_decode_bf16" 2>&1 \
    | tail -4 | tee "$OUT_DIR/gpu_tests_decode.log"
timeout 80 python3 benchmarks/bench_kernels.py --sections decode --decode-cases 1x1024,8x1024 \
    --tune decode --out "$OUT_DIR/short_context" 2>&1 | tail -5
timeout 220 python3 benchmarks/bench_engine.py --shape 8b --executors uni --scheduling sync,async \
    --batch-sizes 1,8,64,256 --context 1024 --decode-steps 30 --throughput-batch 128 --prompt-len 512 \
    --output-len 256 --out "$OUT_DIR" 2>&1 | quiet | grep -v "^{"
timeout 100 python3 benchmarks/gpu_idle.py --shape 8b --batch-sizes 1,64 --context 1024 \
    --scheduling async --out "$OUT_DIR" 2>&1 | quiet | grep -v "^{\|warn"
