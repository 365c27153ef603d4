#!/usr/bin/env bash
# One device call for the engine's H200 figures: CUDA-graph correctness, the engine bench
# (scripts/gpu_engine.sh) and a shortened throughput bench (scripts/gpu_perf.sh's, fewer requests).
set -uo pipefail
export PYTHONUNBUFFERED=1
bash scripts/gpu_engine.sh 2>&1 | grep -v "Loading weights\|it/s\]"
python3 benchmarks/bench_throughput.py --shape 8b --num-requests 300 --max-num-seqs 1024 \
    --max-num-batched-tokens 8192 --gpu-memory-utilization 0.85 --stats-every 8 \
    --hf-requests 128 --hf-batch-size 128 --hf-max-time 30 --out "${OUT:-benchmarks/results}" 2>&1 \
    | grep -v "Loading weights\|it/s\]"
