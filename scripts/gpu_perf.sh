#!/usr/bin/env bash
# Issue 8's offline-throughput and memory benchmarks on the H200, in one device call (no Ray):
# an 8B-shaped Llama with random bf16 weights serves 1,000 ShareGPT-like requests
#   1. through raypaged, paged KV cache (pool profiled at --gpu-memory-utilization 0.85);
#   2. through raypaged with kv_cache_mode "contiguous" (every request reserves max_model_len =
#      8,192 slots, the model's context) on exactly the same number of blocks;
#   3. through transformers `generate`, static batches of 128, on the first 128 requests, a batch
#      cut after 60 s (what it produced by then counts; the uncut projection is recorded too).
# Expected to take 4-6 minutes. The JSON is rewritten after each phase, so a cut run keeps what
# it measured. Writes throughput_8b_h200.json and .png to $OUT.
#   run: RAYPAGED_COMMIT=<sha> bash scripts/gpu_perf.sh
set -euo pipefail
source "$(dirname "$0")/gpu_setup.sh"
python3 benchmarks/bench_throughput.py --shape 8b --num-requests 1000 --max-num-seqs 1024 \
    --max-num-batched-tokens 8192 --gpu-memory-utilization 0.85 --stats-every 8 \
    --hf-requests 128 --hf-batch-size 128 --hf-max-time 60 --out "$OUT_DIR" "$@" 2>&1 \
    | tee "$OUT_DIR/throughput_bench.log"
