#!/usr/bin/env bash
# Issue 8: rope and SwiGLU in the skinny GEMM's epilogue (raypaged/kernels/gemv_epilogues.py) on the H200,
# in one call (~8 minutes, each part under a timeout):
#   1. the GPU tests of the GEMM (the epilogues bit for bit against the GEMM then the separate
#      kernel, at the 8B's shapes with the configs the engine uses) and of PDL;
#   2. the engine's decode step at batch 1, 8, 64 (context 1,024, async, in process) with the
#      epilogues off (RAYPAGED_GEMM_EPILOGUES=0) and on, alternately, twice;
#   3. the idle trace's per-kernel times at batch 1 and 64 with them on (PDL off: kernel times
#      do not overlap).
# Prediction before the run: the rope and SiLU kernels go (at batch 64, 0.10 + 0.08 ms of the
# PDL-off trace), qkv moves from cuBLAS to the kernel at 64 rows (+0.02 ms): ~0.1 ms a step less
# at batch 1 and 64.
#   run: RAYPAGED_COMMIT=<sha> bash scripts/gpu_epilogues.sh
set -uo pipefail
source "$(dirname "$0")/gpu_setup.sh"
timeout 150 python3 -m pytest -q -m gpu -p no:cacheprovider tests/test_kernels_gemv.py \
    tests/test_kernels_pdl.py 2>&1 | tail -4 | tee "$OUT_DIR/gpu_tests_epilogues.log"
for rep in 1 2; do
    for epilogues in 0 1; do
        dir="$OUT_DIR/epilogues${epilogues}_$rep"
        mkdir -p "$dir"
        echo "== epilogues $epilogues, run $rep"
        RAYPAGED_GEMM_EPILOGUES=$epilogues timeout 110 python3 benchmarks/bench_engine.py --shape 8b \
            --executors uni --scheduling async --batch-sizes 1,8,64 --context 1024 --decode-steps 50 \
            --throughput-batch 8 --prompt-len 64 --output-len 32 --out "$dir" 2>&1 \
            | quiet | grep "decode step\|copy bandwidth"
    done
done
mkdir -p "$OUT_DIR/idle"
RAYPAGED_PDL=0 timeout 90 python3 benchmarks/gpu_idle.py --shape 8b --batch-sizes 1,64 --context 1024 \
    --scheduling async --max-num-seqs 64 --max-num-batched-tokens 8192 --steps 30 \
    --out "$OUT_DIR/idle" 2>&1 | quiet | grep -v "^{\|warn\|wrote"
for batch in 1 64; do
    echo "== idle trace, batch $batch (PDL off)"
    python3 -c "import json,sys; [print(f'    {ms:7.3f} ms  {n[:60]}') for n, ms in json.load(open(sys.argv[1]))['runs']['async/$batch']['top_kernels_ms']]" \
        "$OUT_DIR/idle/gpu_idle_8b_h200.json"
done
