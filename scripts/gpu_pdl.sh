#!/usr/bin/env bash
# Programmatic dependent launch (raypaged/kernels/pdl.py, RAYPAGED_PDL=1) on the H200, in one call
# (~6 minutes, timeouts 170 + 2 x 150 + 60 s): written without a GPU, so first the GPU tests with
# it on (the decode kernels with it on and off in a CUDA graph, bit for bit; the GEMM, attention
# and engine tests), then the engine's decode step at batch 1, 8, 64 (context 1,024, async, in
# process) with it off and then on, each into its own folder, then the idle trace with it on.
# If the tests fail or the step is not faster, the default stays off.
#   run: RAYPAGED_COMMIT=<sha> bash scripts/gpu_pdl.sh
set -uo pipefail
source "$(dirname "$0")/gpu_setup.sh"
RAYPAGED_PDL=1 timeout 170 python3 -m pytest -q -m gpu -p no:cacheprovider tests/test_kernels_pdl.py \
    tests/test_kernels_gemv.py tests/test_engine_generate.py \
    "tests/test_kernels_triton.py::test_gpu_decode_bf16" \
    "tests/test_kernels_triton.py::test_gpu_decode_replays_in_a_cuda_graph" 2>&1 | tail -4 \
    | tee "$OUT_DIR/gpu_tests_pdl.log"
for pdl in 0 1; do
    mkdir -p "$OUT_DIR/pdl$pdl"
    RAYPAGED_PDL=$pdl timeout 150 python3 benchmarks/bench_engine.py --shape 8b --executors uni \
        --scheduling async --batch-sizes 1,8,64 --context 1024 --decode-steps 30 \
        --throughput-batch 64 --prompt-len 512 --output-len 128 --out "$OUT_DIR/pdl$pdl" 2>&1 \
        | quiet | grep "decode step\|copy bandwidth"
done
RAYPAGED_PDL=1 timeout 60 python3 benchmarks/gpu_idle.py --shape 8b --batch-sizes 1,64 --context 1024 \
    --scheduling async --max-num-seqs 64 --max-num-batched-tokens 8192 --out "$OUT_DIR/pdl1" 2>&1 | quiet | grep -v "^{\|warn"
