#!/usr/bin/env bash
# One device call after piecewise CUDA graphs landed: GPU correctness (piecewise graphs, decode
# graphs, kernels incl. the TMA prefill default), a mixed decode + prefill step with and without
# piecewise graphs, the staging copy, and the 1,000-request offline throughput (paged vs the
# max_model_len reservation; transformers is in throughput_8b_h200.json's earlier same-run figure).
#   run: RAYPAGED_COMMIT=<sha> bash scripts/gpu_piecewise.sh
set -uo pipefail
source "$(dirname "$0")/gpu_setup.sh"
timeout 200 python3 -m pytest -q -m gpu -p no:cacheprovider -p no:warnings tests/test_piecewise_graphs.py \
    tests/test_engine_generate.py tests/test_kernels_triton.py 2>&1 | tee "$OUT_DIR/gpu_tests.log" | tail -6
for flag in "" "--no-piecewise-cuda-graph"; do
    timeout 100 python3 benchmarks/profile_step.py --shape 8b --batch-sizes 256 --context 512 \
        --executors uni --mixed-prompt-len 160 --steps 20 $flag --out "$OUT_DIR" 2>&1 \
        | quiet | grep "piecewise\|engine.step\|worker_total\|forward\|captured"
done
timeout 30 python3 benchmarks/bench_staging.py 2>&1 | tail -4
timeout 200 python3 benchmarks/bench_throughput.py --shape 8b --num-requests 1000 --max-total-len 2048 \
    --max-num-seqs 512 --max-num-batched-tokens 8192 --gpu-memory-utilization 0.85 --stats-every 8 \
    --hf-requests 0 --out "$OUT_DIR/piecewise" 2>&1 | quiet | grep -v "^$" | tail -12
