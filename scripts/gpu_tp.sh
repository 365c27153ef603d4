#!/usr/bin/env bash
# Issue 10's tensor-parallel run, in one device call on two H200s of one host (kind
# nvidia-h200-x2; with four, --tp-sizes 1,2,4), NCCL between the Ray worker actors:
#   1. the 8B shape at each TP size: greedy tokens of 4 prompts compared across TP sizes, decode
#      step at batch 1 and 64 (context 1,024), the step's collectives replayed alone in the
#      worker group and the NCCL kernels of 20 live steps, offline throughput of
#      256 x (512 + 256) tokens (benchmarks/bench_tp.py) -> tp_8b_h200.json, .png, .log;
#   2. with --70b, the 70B shape at the same TP sizes -> tp_70b_h200.*: TP=1 is recorded as
#      skipped (141 GB of bf16 weights > 0.85 x the H200's ~150 GB); TP=2 holds 70.6 GB a GPU.
# Time, estimated (nothing of this has run on a GPU yet) from the 8B serving runs' engine start
# (26 s warm, 44 s cold): set-up and Ray's bundle ~30 s; part 1 ~2.5-3 min (TP=1: start ~40 s,
# measuring ~20 s; TP=2: start ~40 s with new attention compiles and NCCL, measuring and probes
# ~40 s). Part 2 ~2.5 min: its dummy weights are quick (each rank draws every tensor whole in
# fp32 on its GPU, 282 GB of writes: seconds); its start-up is ~1-1.5 min of CUDA-graph captures
# (80 layers: 15 piecewise buckets x 81 graphs, 20 decode graphs) and attention compiles (8 query
# heads per KV head), then ~15 PFLOP of prefill per GPU, ~30 s, and its decode steps. ~3.5 min in
# all without --70b, ~6 with. The timeouts (240 + 220 s, 20 s more to kill) hold the whole call
# under 9 minutes; each JSON is rewritten after every TP size, so a cut run keeps what it did.
# NCCL logs its set-up per rank (NVLS off; P2P/NVLink or host memory between the GPUs, as each
# Ray actor sees only its own GPU) into nccl_<host>_<pid>.log, summarised in nccl_transport.log.
#   run: RAYPAGED_COMMIT=<sha> bash scripts/gpu_tp.sh [--70b] [--tp-sizes 1,2]   (.device/ carried)
set -uo pipefail
tp_sizes=1,2
big=0
while [ $# -gt 0 ]; do
    case $1 in
        --70b) big=1 ;;
        --tp-sizes) tp_sizes=$2; shift ;;
        *) echo "unknown argument $1 (expected --70b, --tp-sizes N,M)"; exit 2 ;;
    esac
    shift
done
source "$(dirname "$0")/gpu_setup.sh"
use_ray
# NVLink multicast can take the host's GPUs out of service (issue 10): never on.
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1
export NCCL_DEBUG=INFO NCCL_DEBUG_SUBSYS=INIT NCCL_DEBUG_FILE="$(cd "$OUT_DIR" && pwd)/nccl_%h_%p.log"

# A driver cut short by `timeout` takes its local Ray down with it (SIGTERM: ray.shutdown at exit;
# SIGKILL: Ray's process reaper). What the GPUs still hold before the next part, for the record:
gpu_memory() { nvidia-smi --query-gpu=index,memory.used --format=csv,noheader | tr '\n' ' '; echo; }

timeout -k 20 240 python3 benchmarks/bench_tp.py --shape 8b --tp-sizes "$tp_sizes" --batch-sizes 1,64 \
    --context 1024 --decode-steps 30 --throughput-batch 256 --prompt-len 512 --output-len 256 \
    --profile-steps 20 --out "$OUT_DIR" 2>&1 | quiet | tee "$OUT_DIR/tp_8b_h200.log"
echo "8B part: exit ${PIPESTATUS[0]}; GPU memory used after it: $(gpu_memory)"
if [ "$big" = 1 ]; then
    timeout -k 20 220 python3 benchmarks/bench_tp.py --shape 70b --tp-sizes "$tp_sizes" --batch-sizes 1,64 \
        --context 1024 --decode-steps 30 --throughput-batch 256 --prompt-len 512 --output-len 256 \
        --profile-steps 20 --out "$OUT_DIR" 2>&1 | quiet | tee "$OUT_DIR/tp_70b_h200.log"
    echo "70B part: exit ${PIPESTATUS[0]}"
fi
grep -hi " via \|nvls\|Using network\|init COMPLETE" "$OUT_DIR"/nccl_*.log 2>/dev/null \
    | sed 's/^.*NCCL INFO //; s/0x[0-9a-f]*/0x…/g; s/Channel [0-9\/]*/Channel N/' | sort | uniq -c \
    | head -40 | tee "$OUT_DIR/nccl_transport.log"
