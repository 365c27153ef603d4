#!/usr/bin/env bash
# Issue 8, after PDL (scripts/gpu_pdl.sh): two more changes to the decode step's skinny GEMM, in one
# call (~8 minutes):
#   - with PDL, each program asks the first RAYPAGED_GEMV_PREFETCH_K columns of its weight strip
#     into L2 before it waits for the previous kernel (weights never depend on it);
#   - the skinny GEMM for up to RAYPAGED_GEMV_MAX_ROWS rows (64: batch 64 off cuBLAS too).
# First the GEMM's GPU tests at 64 rows with prefetch, then bench_gemv (no sweep) at 1-64 rows,
# prefetch off and on, then the engine's decode step per setting, the first one again at the end.
#   run: RAYPAGED_COMMIT=<sha> bash scripts/gpu_prefetch.sh
set -uo pipefail
source "$(dirname "$0")/gpu_setup.sh"
export RAYPAGED_PDL=1
RAYPAGED_GEMV_MAX_ROWS=64 RAYPAGED_GEMV_PREFETCH_K=1024 timeout 100 python3 -m pytest -q -m gpu \
    -p no:cacheprovider tests/test_kernels_gemv.py tests/test_kernels_pdl.py 2>&1 | tail -3
for prefetch in 0 1024; do
    mkdir -p "$OUT_DIR/gemv_prefetch$prefetch"
    RAYPAGED_GEMV_MAX_ROWS=64 RAYPAGED_GEMV_PREFETCH_K=$prefetch timeout 80 python3 benchmarks/bench_gemv.py \
        --rows 1,16,32,64 --tune-rows "" --out "$OUT_DIR/gemv_prefetch$prefetch" 2>&1 | grep "rows\|copy"
done
engine() {  # name max_rows prefetch_k
    mkdir -p "$OUT_DIR/$1"
    echo "== $1: max rows $2, prefetch $3"
    RAYPAGED_GEMV_MAX_ROWS=$2 RAYPAGED_GEMV_PREFETCH_K=$3 timeout 75 python3 benchmarks/bench_engine.py \
        --shape 8b --executors uni --scheduling async --batch-sizes 1,8,64 --context 1024 \
        --decode-steps 50 --throughput-batch 64 --prompt-len 128 --output-len 32 --out "$OUT_DIR/$1" \
        2>&1 | quiet | grep "decode step"
}
engine base 16 0
engine prefetch512 16 512
engine prefetch1024 16 1024
engine rows64 64 0
engine rows64_prefetch1024 64 1024
engine base_again 16 0
