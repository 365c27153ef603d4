#!/usr/bin/env bash
# Issue 8, following scripts/gpu_epilogues.sh (c194913: with rope and SwiGLU in the GEMM's epilogue
# batch 64 took 0.08 ms less a step, batch 1 and 8 0.19 and 0.16 ms more, while the PDL-off
# trace at batch 1 had the GEMMs at 3.93 ms against 3.96 for GEMMs + rope + SiLU at 5f5857d).
# Where does batch 1 lose? (~4 minutes) The GEMM tests again (the GPU's tolerance of one bf16
# step), then the idle trace at batch 1 and 64 with the epilogues off and on, PDL off and on,
# each printing what every kernel of a layer adds to the step (gpu_idle.layer_profile).
#   run: RAYPAGED_COMMIT=<sha> bash scripts/gpu_epilogues_trace.sh
set -uo pipefail
source "$(dirname "$0")/gpu_setup.sh"
timeout 100 python3 -m pytest -q -m gpu -p no:cacheprovider tests/test_kernels_gemv.py 2>&1 | tail -3 \
    | tee "$OUT_DIR/gpu_tests_gemv.log"
for pdl in 1 0; do
    for epilogues in 0 1; do
        dir="$OUT_DIR/pdl${pdl}_epilogues$epilogues"
        mkdir -p "$dir"
        echo "== PDL $pdl, epilogues $epilogues"
        RAYPAGED_PDL=$pdl RAYPAGED_GEMM_EPILOGUES=$epilogues timeout 80 python3 benchmarks/gpu_idle.py \
            --shape 8b --batch-sizes 1,64 --context 1024 --scheduling async --max-num-seqs 64 \
            --max-num-batched-tokens 8192 --steps 20 --out "$dir" 2>&1 | quiet | grep -v "^{\|warn\|wrote"
        python3 - "$dir/gpu_idle_8b_h200.json" <<'PY'
import json, sys
runs = json.load(open(sys.argv[1]))["runs"]
for batch in (1, 64):
    layer = runs[f"async/{batch}"]["per_layer_us"]
    total = sum(adds for _, adds in layer.values())
    print(f"   batch {batch}: a layer adds {total:.1f} us; " + ", ".join(
        f"{label.replace('_kernel', '')} {dur:.1f}/{adds:.1f}" for label, (dur, adds) in layer.items()))
PY
    done
done
