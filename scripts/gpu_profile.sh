#!/usr/bin/env bash
# One device call: where a decode step's time goes (benchmarks/profile_step.py, in process and
# through a Ray actor, batch 1 and 64) and the 1,000-request offline throughput run of issue 8
# (ShareGPT-like, pruned at prompt + output <= 2,048 as vLLM's benchmark does; max_model_len
# stays the model's 8,192, which is what the contiguous mode reserves per request).
#   run: RAYPAGED_COMMIT=<sha> bash scripts/gpu_profile.sh   (with .device/ carried, for Ray)
set -uo pipefail
source "$(dirname "$0")/gpu_setup.sh"
use_ray
timeout 200 python3 benchmarks/profile_step.py --shape 8b --batch-sizes 1,64 --context 1024 \
    --executors uni,ray --out "$OUT_DIR" 2>&1 | quiet
timeout 360 python3 benchmarks/bench_throughput.py --shape 8b --num-requests 1000 --max-total-len 2048 \
    --max-num-seqs 512 --max-num-batched-tokens 8192 --gpu-memory-utilization 0.85 --stats-every 8 \
    --hf-requests 128 --hf-batch-size 128 --hf-max-time 60 --out "$OUT_DIR" 2>&1 \
    | quiet
