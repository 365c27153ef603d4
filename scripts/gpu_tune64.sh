#!/usr/bin/env bash
# Issue 8, batch 64 (~7 minutes): the skinny GEMM at 64 rows with split-K and wider tiles. Its GPU
# tests (PDL on, the default now), then bench_gemv's sweep at 64 rows writing the H200's tuned
# table (raypaged/kernels/configs/gemv_nvidia_h200.json: per 8B shape, the kernel's best config or cuBLAS,
# whichever was faster), then the engine's decode step without the table, with it, and without
# it again.
#   run: RAYPAGED_COMMIT=<sha> bash scripts/gpu_tune64.sh
set -uo pipefail
source "$(dirname "$0")/gpu_setup.sh"
TABLE=raypaged/kernels/configs/gemv_nvidia_h200.json
timeout 120 python3 -m pytest -q -m gpu -p no:cacheprovider tests/test_kernels_gemv.py \
    tests/test_kernels_pdl.py 2>&1 | tail -3
rm -f "$TABLE"
timeout 260 python3 benchmarks/bench_gemv.py --rows 16,32,64 --tune-rows 64 --table "$TABLE" \
    --out "$OUT_DIR/gemv64" 2>&1 | grep "rows\|copy\|table"
cp "$TABLE" "$OUT_DIR/"
engine() {  # name
    mkdir -p "$OUT_DIR/$1"
    echo "== $1"
    timeout 70 python3 benchmarks/bench_engine.py --shape 8b --executors uni --scheduling async \
        --batch-sizes 1,8,64 --context 1024 --decode-steps 50 --throughput-batch 64 --prompt-len 128 \
        --output-len 32 --out "$OUT_DIR/$1" 2>&1 | quiet | grep "decode step"
}
mv "$TABLE" /tmp/table.json && engine no_table
mv /tmp/table.json "$TABLE" && engine table
mv "$TABLE" /tmp/table.json && engine no_table_again
mv /tmp/table.json "$TABLE"
