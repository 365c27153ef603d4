#!/usr/bin/env bash
# Issue 8's "≥ 2× the reservation mode" at a long-context model's window, in one device call
# (~4 minutes): the 1,000-request ShareGPT-like throughput run of scripts/gpu_profile.sh (the same
# requests: pruned at prompt + output <= 2,048) on the 8B shape with Llama 3.1's longer context
# capped at 32k (shape 8b-32k), paged vs contiguous on the same pool. The contiguous mode reserves
# max_model_len = 32,768 slots per request; at 8,192 (gpu_profile.sh) it seated 102 requests.
# transformers is left out: gpu_profile.sh measures it on the same requests.
#   run: RAYPAGED_COMMIT=<sha> bash scripts/gpu_reservation.sh
set -uo pipefail
source "$(dirname "$0")/gpu_setup.sh"
timeout 420 python3 benchmarks/bench_throughput.py --shape 8b-32k --num-requests 1000 \
    --max-total-len 2048 --max-num-seqs 512 --max-num-batched-tokens 8192 \
    --gpu-memory-utilization 0.85 --stats-every 8 --hf-requests 0 --out "$OUT_DIR" "$@" 2>&1 | quiet
