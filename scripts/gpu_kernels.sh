#!/usr/bin/env bash
# What runs on the GPU machine (the `run` tool), from the repository root:
#   RAYPAGED_COMMIT=<sha> [GPU_TEST_FILTER=<pytest -k expr>] bash scripts/gpu_kernels.sh [bench args]
# 1. installs the package (editable, no downloads), 2. runs the GPU-marked kernel tests in bf16
# with the real compiler (not the interpreter), 3. runs benchmarks/bench_kernels.py.
# Logs, JSON and PNG go to $OUT (or benchmarks/results when $OUT is unset).
set -uo pipefail
source "$(dirname "$0")/gpu_setup.sh"

nvidia-smi --query-gpu=name,memory.total,clocks.sm,clocks.mem --format=csv

# A test failure is reported but does not stop the timings.
timeout 240 python3 -m pytest tests/test_kernels_triton.py -m gpu -q -p no:cacheprovider \
    -p no:warnings ${GPU_TEST_FILTER:+-k "$GPU_TEST_FILTER"} 2>&1 | tee "$OUT_DIR/kernels_gpu_tests.log" | tail -25
tests_rc=${PIPESTATUS[0]}

python3 benchmarks/bench_kernels.py --out "$OUT_DIR" "$@" 2>&1 | tee "$OUT_DIR/kernels_bench.log" \
    | grep -v "^  prefill "
bench_rc=${PIPESTATUS[0]}
echo "gpu tests rc=$tests_rc  bench rc=$bench_rc"
exit $(( tests_rc != 0 || bench_rc != 0 ))
