#!/usr/bin/env bash
# Issue 8 (~3 minutes): rope folded into the KV write (kernels/write_kv.py, one kernel where a
# decode step had two a layer). The GPU tests it touches (the fused kernel bit for bit against
# rope-then-write, piecewise graphs, the engine against transformers in fp32 with graphs and
# async scheduling on and off), then the engine's decode step at batch 1 and 64.
# Prediction: ~0.05 ms less a step at batch 1 and 64 (rope + KV write were 0.10 / 0.15 ms).
#   run: RAYPAGED_COMMIT=<sha> bash scripts/gpu_rope_kv.sh
set -uo pipefail
source "$(dirname "$0")/gpu_setup.sh"
timeout 110 python3 -m pytest -q -m gpu -p no:cacheprovider tests/test_kernels_triton.py \
    tests/test_piecewise_graphs.py tests/test_engine_generate.py 2>&1 | tail -3 \
    | tee "$OUT_DIR/gpu_tests_rope_kv.log"
timeout 75 python3 benchmarks/bench_engine.py --shape 8b --executors uni --scheduling async \
    --batch-sizes 1,64 --context 1024 --decode-steps 50 --throughput-batch 64 --prompt-len 128 \
    --output-len 32 --out "$OUT_DIR" 2>&1 | quiet | grep "decode step\|copy"
