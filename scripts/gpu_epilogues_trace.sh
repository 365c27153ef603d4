#!/usr/bin/env bash
# Issue 8, following scripts/gpu_epilogues.sh (c194913: with rope and SwiGLU in the GEMM's epilogue
# batch 64 took 0.08 ms less a step, batch 1 and 8 0.19 and 0.16 ms more). Where is it lost?
# (~5 minutes) The GEMM and PDL GPU tests, then the idle trace at batch 1 and 64 (PDL on) for
# several settings of RAYPAGED_GEMM_EPILOGUES and RAYPAGED_GEMM_TRIGGER, each printing what every
# kernel of a layer adds to the step (gpu_idle.layer_profile; labels count from the attention).
#   run: RAYPAGED_COMMIT=<sha> bash scripts/gpu_epilogues_trace.sh [epilogues/trigger ...]
#   12e0e04: 0/start rope,silu/start (and PDL off for both)
set -uo pipefail
source "$(dirname "$0")/gpu_setup.sh"
timeout 130 python3 -m pytest -q -m gpu -p no:cacheprovider tests/test_kernels_gemv.py \
    tests/test_kernels_pdl.py 2>&1 | tail -3 | tee "$OUT_DIR/gpu_tests_gemv.log"
settings=("$@")
[ ${#settings[@]} -eq 0 ] && settings=(0/start rope,silu/start)
for setting in "${settings[@]}"; do
    epilogues=${setting%/*} trigger=${setting#*/}
    dir="$OUT_DIR/$(echo "$setting" | tr ',/' '_-')"
    mkdir -p "$dir"
    echo "== epilogues $epilogues, GEMM trigger at $trigger"
    RAYPAGED_GEMM_EPILOGUES=$epilogues RAYPAGED_GEMM_TRIGGER=$trigger timeout 80 python3 \
        benchmarks/gpu_idle.py --shape 8b --batch-sizes 1,64 --context 1024 --scheduling async \
        --max-num-seqs 64 --max-num-batched-tokens 8192 --steps 20 --out "$dir" 2>&1 \
        | quiet | grep "GPU busy"
    python3 - "$dir/gpu_idle_8b_h200.json" <<'PY'
import json, sys
runs = json.load(open(sys.argv[1]))["runs"]
for batch in (1, 64):
    layer = runs[f"async/{batch}"]["per_layer_us"]
    order = sorted(layer, key=lambda label: ("decode_split" not in label, label))
    print(f"   batch {batch}: a layer adds {sum(adds for _, adds in layer.values()):.1f} us; " + ", ".join(
        f"{label.replace('_kernel', '')[:24]} {layer[label][0]:.1f}/{layer[label][1]:.1f}" for label in order))
PY
done
