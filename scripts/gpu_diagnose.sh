#!/usr/bin/env bash
# One device call of measurements that say where time goes (issues 3, 5, 8), each logged to $OUT:
#   Ray's dispatch cost apart from the work; the engine's decode step by phase (in process and
#   through Ray) and a mixed decode + prefill step; the eager 8B forward's profile by op and
#   kernel; the prefill-kernel candidates (scripts/gpu_prefill_tune.sh).
#   run: RAYPAGED_COMMIT=<sha> bash scripts/gpu_diagnose.sh   (with .device/ carried, for Ray)
set -uo pipefail
source "$(dirname "$0")/gpu_setup.sh"
use_ray
timeout 60 python3 benchmarks/bench_ray_channel.py --gpu --out "$OUT_DIR" 2>&1 | quiet | tail -3
timeout 150 python3 benchmarks/profile_step.py --shape 8b --batch-sizes 1,64 --context 1024 \
    --executors uni,ray --out "$OUT_DIR" 2>&1 | quiet | tail -16
timeout 90 python3 benchmarks/profile_step.py --shape 8b --batch-sizes 256 --context 512 \
    --executors uni --mixed-prompt-len 160 --steps 20 --out "$OUT_DIR" 2>&1 | quiet | tail -16
timeout 120 python3 benchmarks/bench_model_step.py --skip-check --profile --batches 1 64 \
    --out "$OUT_DIR/model_step_profile_h200.json" >"$OUT_DIR/model_step_profile.log" 2>&1
grep "decode B=\|prefill" "$OUT_DIR/model_step_profile.log"
if [ -f scripts/gpu_prefill_tune.sh ]; then
    timeout 200 bash scripts/gpu_prefill_tune.sh 2>&1 | tail -40
fi
