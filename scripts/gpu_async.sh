#!/usr/bin/env bash
# Asynchronous scheduling on the H200, in one device call (~8 minutes; issues 5 and 8):
#   1. the GPU tests of the engine (greedy == transformers in fp32, CUDA graphs on and off,
#      piecewise graphs), each with asynchronous scheduling off and on;
#   2. decode step time of the 8B-shaped model at batch 1, 8, 64 and 256 (context 1,024), in
#      process and through a Ray actor, each with scheduling sync and async (Ray's cost per step
#      = ray / uni - 1 within a scheduling mode);
#   3. the 1,000-request offline throughput run (scripts/gpu_profile.sh's requests), paged, with
#      asynchronous scheduling (throughput_8b_h200.json; scripts/gpu_async_throughput.sh runs
#      sync and async in one call).
#   run: RAYPAGED_COMMIT=<sha> bash scripts/gpu_async.sh   (with .device/ carried, for Ray)
set -uo pipefail
source "$(dirname "$0")/gpu_setup.sh"
use_ray
timeout 150 python3 -m pytest -q -m gpu tests/test_engine_generate.py tests/test_piecewise_graphs.py \
    -p no:cacheprovider 2>&1 | tail -5 | tee "$OUT_DIR/gpu_tests_async.log"
timeout 330 python3 benchmarks/bench_engine.py --shape 8b --executors uni,ray --scheduling sync,async \
    --batch-sizes 1,8,64,256 --context 1024 --decode-steps 30 --throughput-batch 128 \
    --prompt-len 512 --output-len 256 --out "$OUT_DIR" 2>&1 | quiet
timeout 110 python3 benchmarks/bench_throughput.py --shape 8b --num-requests 1000 --max-total-len 2048 \
    --max-num-seqs 512 --max-num-batched-tokens 8192 --gpu-memory-utilization 0.85 --stats-every 8 \
    --hf-requests 0 --modes paged --out "$OUT_DIR" 2>&1 | quiet  # async scheduling: the default
