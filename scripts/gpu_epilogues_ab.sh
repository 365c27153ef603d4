#!/usr/bin/env bash
# Issue 8 (~6 minutes): the engine's decode step at batch 1, 8, 64 (context 1,024, async, in
# process), three settings taken in turn, twice:
#   before   RAYPAGED_GEMM_EPILOGUES=0 RAYPAGED_GEMM_TRIGGER=start (the tree before c194913)
#   now      the defaults: rope and SwiGLU in the GEMM's epilogue, the SwiGLU one letting the
#            down projection launch at its end (gemv._dependents_at_end)
#   o_kernel the defaults with the o projection at 64 rows on the kernel, not cuBLAS (the
#            table's entry edited for the run): does leaving cuBLAS out of the PDL chain pay?
# then `now` at batch 1, 8, 64, 256 for the README's table.
#   run: RAYPAGED_COMMIT=<sha> bash scripts/gpu_epilogues_ab.sh [o_kernel]
#   2c836ae (every GEMM triggering at its end): before / now / o_kernel, twice, in one call
#   later: before / now only (o_kernel was no faster), unless `o_kernel` is given; REPS=2 at
#   the last call (after the GEMM tests)
set -uo pipefail
source "$(dirname "$0")/gpu_setup.sh"
TABLE=raypaged/kernels/configs/gemv_nvidia_h200.json
cp "$TABLE" /tmp/table.json
engine() {  # name batch-sizes [env...]
    local name=$1 batches=$2
    shift 2
    mkdir -p "$OUT_DIR/$name"
    echo "== $name"
    env "$@" timeout 110 python3 benchmarks/bench_engine.py --shape 8b --executors uni --scheduling async \
        --batch-sizes "$batches" --context 1024 --decode-steps 50 --throughput-batch 8 --prompt-len 64 \
        --output-len 32 --out "$OUT_DIR/$name" 2>&1 | quiet | grep "decode step\|copy bandwidth"
    rm -f "$OUT_DIR/$name"/*.png  # a call brings back at most eight files: the JSONs first
}
o_on_kernel() {
    python3 - "$TABLE" <<'PY'
import json, sys
table = json.load(open(sys.argv[1]))
for entry in table["entries"]:
    if (entry["out"], entry["in"], entry["rows"]) == (4096, 4096, 64):
        entry["backend"] = "triton"
json.dump(table, open(sys.argv[1], "w"), indent=1)
PY
}
timeout 130 python3 -m pytest -q -m gpu -p no:cacheprovider tests/test_kernels_gemv.py \
    tests/test_kernels_pdl.py 2>&1 | tail -3 | tee "$OUT_DIR/gpu_tests_gemv.log"
for run in $(seq "${REPS:-3}"); do
    engine "before_$run" 1,8,64 RAYPAGED_GEMM_EPILOGUES=0 RAYPAGED_GEMM_TRIGGER=start
    engine "now_$run" 1,8,64
    if [ "${1:-}" = o_kernel ]; then
        o_on_kernel
        engine "o_kernel_$run" 1,8,64
        cp /tmp/table.json "$TABLE"
    fi
done
engine now_all 1,8,64,256
