#!/usr/bin/env bash
# The engine on the H200, in one device call (issues 4 and 5): an 8B-shaped Llama with random
# bf16 weights through the whole engine — decode step time at batch 1, 8, 64 and 256 in process and
# through a Ray actor, output tokens/s at batch 128 x (512 + 256) beside transformers generate.
#   run: bash scripts/gpu_engine.sh   (with .device/ carried: the Ray bundle, see GPU.md)
set -euo pipefail
source "$(dirname "$0")/gpu_setup.sh"
use_ray
python3 -m pytest -q -m gpu tests/test_engine_generate.py -p no:cacheprovider
python3 benchmarks/bench_engine.py --shape 8b --hf --executors uni,ray --batch-sizes 1,8,64,256 \
  --context 1024 --decode-steps 30 --throughput-batch 128 --prompt-len 512 --output-len 256 \
  --out "$OUT_DIR"
