#!/usr/bin/env bash
# Issue 8, batch 64 (~2 minutes): the idle trace's per-kernel GPU times at batch 64 (PDL off, so
# kernel times do not overlap) with the H200's tuned GEMM table, and without it.
#   run: RAYPAGED_COMMIT=<sha> bash scripts/gpu_idle64.sh
set -uo pipefail
source "$(dirname "$0")/gpu_setup.sh"
TABLE=raypaged/kernels/configs/gemv_nvidia_h200.json
idle() {  # name
    echo "== $1"
    RAYPAGED_PDL=0 timeout 60 python3 benchmarks/gpu_idle.py --shape 8b --batch-sizes 64 --context 1024 \
        --scheduling async --max-num-seqs 64 --max-num-batched-tokens 8192 --steps 30 \
        --out "$OUT_DIR/$1" 2>&1 | quiet | grep -v "^{\|warn\|wrote"
    python3 -c "import json,sys; [print(f'    {ms:7.3f} ms  {n[:60]}') for n, ms in json.load(open(sys.argv[1]))['runs']['async/64']['top_kernels_ms'][6:]]" "$OUT_DIR/$1/gpu_idle_8b_h200.json"
}
idle table
mv "$TABLE" /tmp/table.json && idle no_table
mv /tmp/table.json "$TABLE"
