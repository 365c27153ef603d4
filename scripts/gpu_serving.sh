#!/usr/bin/env bash
# Issue 8's serving benchmark on the H200, in one device call (~7 minutes): an 8B-shaped Llama
# with random bf16 weights behind `raypaged launch` (Ray, from the .device/ bundle), Poisson
# arrivals over gRPC at 24, 40, 64 and 96 req/s, 1,000 ShareGPT-like requests per rate (those
# over 2,048 tokens dropped, as vLLM's benchmark does), streamed; TTFT / ITL / E2E percentiles,
# throughput and the KV pool per rate;
#   1. paged KV cache (pool profiled at --gpu-memory-utilization 0.85);
#   2. --kv-cache-mode contiguous (every request reserves max_model_len = 8,192 slots: 102 seats
#      in this pool) on exactly the paged server's number of blocks.
# Each mode first runs 200 untimed requests at the lowest rate (a fresh machine's first minutes
# pay one-off costs: the fc27d85 run's first rate had p99 TTFT 5.1 s, the next 54 ms), and 1,000
# requests per rate so that the offered load, not the drain of the longest requests, dominates
# (200 per rate at fc27d85 never ran more than 31 requests at once). A mode's sweep stops after a
# rate with p99 TTFT over 10 s, and starts no rate that would end past 220 s of that mode.
# Writes serving_8b_h200.json and .png to $OUT (the JSON after every rate).
#   run: RAYPAGED_COMMIT=<sha> bash scripts/gpu_serving.sh   (with .device/ carried)
# Later flags override these (e.g. --rates 24,40,56 --mode-budget-s 170).
set -euo pipefail
source "$(dirname "$0")/gpu_setup.sh"
use_ray  # raypaged launch runs the engine in a Ray actor
python3 benchmarks/bench_serving.py --shape 8b --rates 24,40,64,96 --num-requests 1000 \
    --warmup-rate-requests 200 --max-total-len 2048 --stop-ttft-s 10 --mode-budget-s 220 \
    --out "$OUT_DIR" "$@" \
    -- --max-model-len 8192 --max-num-seqs 512 --max-num-batched-tokens 8192 \
    --gpu-memory-utilization 0.85 2>&1 \
    | quiet | tee "$OUT_DIR/serving_bench.log"
