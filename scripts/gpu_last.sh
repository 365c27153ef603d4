#!/usr/bin/env bash
# The session's last device call: GPU correctness (piecewise graphs, decode graphs, kernels), the
# engine's decode step in process vs through Ray (issue 5), and the serving benchmark (issue 8).
#   run: RAYPAGED_COMMIT=<sha> bash scripts/gpu_last.sh   (with .device/ carried, for Ray)
set -uo pipefail
source "$(dirname "$0")/gpu_setup.sh"
timeout 150 python3 -m pytest -q -m gpu -p no:cacheprovider -p no:warnings tests/test_piecewise_graphs.py \
    tests/test_engine_generate.py tests/test_kernels_triton.py 2>&1 | tee "$OUT_DIR/gpu_tests.log" | tail -4
use_ray
timeout 110 python3 benchmarks/bench_engine.py --shape 8b --executors uni,ray --batch-sizes 1,64 \
    --context 1024 --decode-steps 40 --throughput-batch 128 --prompt-len 512 --output-len 256 \
    --out "$OUT_DIR" 2>&1 | grep "^|"
timeout 280 bash scripts/gpu_serving.sh --mode-budget-s 95 2>&1 | grep -v "^\[" | tail -25
