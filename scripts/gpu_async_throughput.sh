#!/usr/bin/env bash
# Offline throughput with asynchronous scheduling off and on, in one device call (~3 minutes):
# scripts/gpu_profile.sh's 1,000 ShareGPT-like requests, paged only, no transformers.
# Writes throughput_8b_h200_sync.json and throughput_8b_h200_async.json under $OUT.
#   run: RAYPAGED_COMMIT=<sha> bash scripts/gpu_async_throughput.sh
set -uo pipefail
source "$(dirname "$0")/gpu_setup.sh"
mkdir -p "$OUT_DIR/async"
args=(--shape 8b --num-requests 1000 --max-total-len 2048 --max-num-seqs 512
      --max-num-batched-tokens 8192 --gpu-memory-utilization 0.85 --stats-every 8 --hf-requests 0
      --modes paged)
timeout 100 python3 benchmarks/bench_throughput.py "${args[@]}" --no-async-scheduling --out "$OUT_DIR" 2>&1 | quiet
timeout 100 python3 benchmarks/bench_throughput.py "${args[@]}" --out "$OUT_DIR/async" 2>&1 | quiet
mv "$OUT_DIR/async/throughput_8b_h200.json" "$OUT_DIR/throughput_8b_h200_async.json"
