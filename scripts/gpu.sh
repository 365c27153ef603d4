#!/usr/bin/env bash
# The GPU runs, by suite, from the repository root of a working tree on the device machine:
#
#   RAYPAGED_COMMIT=<sha> bash scripts/gpu.sh SUITE [SUITE ...]
#
# Each suite is one benchmark command (below) writing its JSON (and PNG) to $OUT when set -- the
# folder the device tool brings back, at most eight files a call -- else to benchmarks/results/;
# its log goes to $OUT/<suite>.log (or /tmp/raypaged_gpu/). The device tree has no .git: pass the
# commit in RAYPAGED_COMMIT, which every result records. Set-up (once a call): raypaged installed in
# place with no downloads, the real Triton compiler (tests/conftest.py defaults TRITON_INTERPRET
# to 1 for CPU runs), and for the suites marked Ray the .device/ bundle (../shared/device/GPU.md:
# `make-bundle.sh .device`, carried with the call) plus the gRPC health / reflection wheels the
# frontend needs (1.84.0: the machine's grpcio; `pip download --no-deps -d .device
# "grpcio-health-checking==1.84.0" "grpcio-reflection==1.84.0"`). The kernels suite's peer,
# FlashInfer, comes from the wheels in .whl/ (flashinfer-python 0.5.3 and apache-tvm-ffi 0.1.6,
# ignored by git: carry .whl with the call); without them it is reported absent. The structured suite
# needs xgrammar, which the machine lacks, from .whl/structured/: `pip download --no-deps
# --only-binary=:all: --python-version 3.12 --platform manylinux_2_28_x86_64 --platform
# manylinux2014_x86_64 -d .whl/structured xgrammar==0.2.9 apache-tvm-ffi==0.1.15.post2 pydantic==2.13.4
# pydantic-core==2.46.4 annotated-types typing-inspection` (pinned: unpinned, pydantic-core resolves
# to a placeholder 0.0.1 wheel). The suites that start `raypaged serve` (chaos)
# need Ray Serve's dependencies too, from .device/serve/ (carried in .device): `pip download
# --only-binary=:all: --python-version 3.12 --implementation cp --platform manylinux_2_28_x86_64
# --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 -d .device/serve fastapi starlette
# "uvicorn[standard]" aiohttp aiohttp_cors opencensus opentelemetry-sdk opentelemetry-proto
# opentelemetry-exporter-prometheus prometheus_client smart_open watchfiles mmh3 colorful
# pydantic==2.13.4`, less the large wheels Serve does not import (virtualenv, cryptography, uvloop).
#
# Suites (minutes on one H200, from the last runs; a device call is at most 10 minutes):
#   tests        every GPU-marked test (bf16 kernels at the 8B's shapes, PDL on/off bit for bit,
#                the engine against transformers in fp32 with CUDA graphs, windows and soft caps,
#                FP8, logit_bias / prompt logprobs and constrained requests with graphs; carry .whl
#                for xgrammar): past one call's 540 s since the FP8 / groups / window additions -- run
#                its halves, tests-kernels (tests/kernels) and tests-engine (everything else), a call each
#   kernels      decode / prefill attention against FlashInfer (the .whl/ wheels, carried) and SDPA:
#                bandwidth, TFLOP/s, targets -> kernels_h200.json, .png, ~6 (FlashInfer compiles ~2-3)
#   decode       the 8B engine's decode step at batch 1, 8, 64, 256 -> decode_8b_h200.json, .png, ~3
#   decode-families  the same at batch 1 and 64 for Qwen3-8B, Gemma-2-9B and Phi-3-medium's shapes
#                (dummy weights) -> decode_<shape>_h200.json, .png each, ~6 (not yet run)
#   trace        the same step traced: GPU busy vs wall, kernels -> decode_trace_8b_h200.json, .png, ~2
#   phases       host phases of a step, in process and through Ray [Ray] -> decode_phases_8b_h200.json, ~3
#   model        the model alone, eager and CUDA graph -> decode_model_8b_h200.json, ~2
#   model-fp8    the same with FP8 weights (quantized at load) -> decode_model_fp8_8b_h200.json, ~2
#   gemv         every linear at 1 / 16 / 64 rows against cuBLAS -> gemv_h200.json, .png, ~2
#   gemv-fp8     every linear with an e4m3 weight: the weight-only kernel's configs swept at 1 row and
#                the fused W8A8 kernel's (kernels/gemm_w8a8.py) at 16-256 rows (winners recorded in the
#                device's tuned table, raypaged/kernels/configs/, which the FP8 steps then launch; the
#                table is copied to $OUT), then W8A16 vs W8A8 _scaled_mm vs fused W8A8 vs bf16 cuBLAS at
#                1-512 rows -> gemv_fp8_<device>.json + the table, ~4 before the fused sweep, which adds
#                ~51 compiles and ~480 timings (not yet run; 540 s cap; run it before model-fp8)
#   quality      the trained demo model's held-out perplexity and greedy agreement (32 x 256 tokens),
#                bf16 baseline vs fp32, FP8 weights, FP8 KV and both -> quality_demo_h200.json, .png
#   prefill      every prefill variant against SDPA -> prefill_variants_h200.json, .png, ~3
#   throughput   1,000 ShareGPT-like requests: paged, contiguous, transformers -> throughput_8b_h200.json, .png, ~6
#   throughput-fp8  the same 1,000 requests, paged, at bf16 and at FP8 weights + FP8 KV (issue 22: fp8 / bf16
#                >= 1.5x) -> throughput_8b-fp8_h200.json, .png, ~3 (estimated; not yet run)
#   throughput-fp8-steps  the same at bf16, FP8 weights alone, FP8 KV alone and both, 20 mid-run steps of
#                each traced (GPU time a step by kernel family: GEMMs, the activations' quantization,
#                attention over the FP8 pool): what makes the FP8 step slower -> throughput_8b-fp8-steps_<device>.json,
#                .png, ~6 (estimated; not yet run)
#   throughput-fixed  1,000 requests of exactly 1,000 prompt / 1,000 output tokens at once, paged, fp8 then
#                bf16, beside TensorRT-LLM's published 17,744 tok/s (Llama-3.1-8B FP8, one H200; recorded,
#                not measured) -> throughput_8b-fixed-fp8_h200.json, .png, ~5 (estimated; not yet run; the
#                JSON is written after each precision, so a cut run keeps fp8's figure)
#   reservation  the same at a 32k window, paged vs contiguous -> throughput_8b-32k_h200.json, .png, ~7
#   kvcapacity   the profiled KV pool at bf16 vs FP8 KV: blocks, and the 8k-token requests that fit
#                (checked by running one more) -> kv_capacity_8b_h200.json, ~5
#   serving      Poisson arrivals over gRPC, paged vs contiguous [Ray] -> serving_8b_h200.json, .png, ~8
#   serving-multiturn  multi-turn chat (shared system prompt, whole history resent), prefix caching
#                on vs off [Ray] -> serving_8b-multiturn_h200.json, .png, ~6
#   serving-multitenant  8 tenants' system prompts, two data-parallel engines sharing the GPU (0.45 of
#                its memory each): prefix router vs p2c vs round robin vs one engine with both pools [Ray]
#                -> serving_8b-multitenant_h200.json, .png, ~9
#   serving-host-tier  the same chat trace on a pool (7,500 blocks, 15 GiB) a few times smaller than
#                its reusable KV: prefix caching alone vs with a 48 GiB host tier [Ray]
#                -> serving_8b-host-tier_h200.json, .png (not yet run)
#   serving-swap the same, overloaded (rates 4, 8): host tier with recompute vs swap preemption
#                [Ray] -> serving_8b-swap_h200.json, .png (not yet run)
#   channel      Ray compiled-graph round trips [Ray] -> ray_channel_gpu.json, ~1
#   staging      host cost of staging a step's inputs -> staging_h200.json, <1
#   sampler      the sampler's forward and metadata build -> sampler_h200.json, <1
#   structured   decode at batch 64 with half the requests under a JSON schema vs none, and grammar
#                compile times (carry .whl: xgrammar's wheels in .whl/structured/) -> structured_8b_h200.json, .png, ~3
#   tp           tensor parallelism at TP 1 and 2 (kind nvidia-h200-x2) [Ray] -> tp_8b_h200.json, .png, ~4
#   faults       a TP=2 rank killed / raising / hanging (kind nvidia-h200-x2) [Ray] -> faults_h200x2.json, ~2
#   chaos        the chaos soak on the demo model (fp32) over gRPC and HTTP at TP 1 with a Ray worker
#                actor: engine actor SIGKILLed, worker SIGKILLed and hung, once each; every stream
#                checked against a fault-free run [Ray] -> chaos_<device>.json, ~2
#   all          every one-GPU suite above, in order (longer than one device call: name suites instead)
# A suite's failure is reported and the next suite still runs; the exit status is 1 if any failed.
set -uo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
export PYTHONUNBUFFERED=1 TRITON_INTERPRET=0
OUT_DIR=${OUT:-benchmarks/results}
LOG_DIR=${OUT:-/tmp/raypaged_gpu}
mkdir -p "$OUT_DIR" "$LOG_DIR"
ONE_GPU=(tests kernels decode decode-families trace phases model model-fp8 gemv gemv-fp8 quality prefill throughput
         throughput-fp8 throughput-fp8-steps throughput-fixed reservation
         kvcapacity serving serving-multiturn serving-multitenant serving-host-tier serving-swap channel staging
         sampler structured chaos)
# NVLink multicast can take the host's GPUs out of service (issue 10): never on.
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1

setup() {
    python3 -m pip install -q --no-deps --no-build-isolation -e . >/tmp/raypaged_pip.log 2>&1 \
        || { cat /tmp/raypaged_pip.log; exit 1; }
    nvidia-smi --query-gpu=name,memory.total,clocks.sm,clocks.mem --format=csv,noheader 2>/dev/null || true
}

use_wheels() {  # the benchmark-only packages carried as wheels in .whl/ (FlashInfer and tvm-ffi), if any
    ls .whl/*.whl >/dev/null 2>&1 || { echo "no .whl/: FlashInfer will be reported absent"; return 0; }
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site \
        .whl/*.whl || { echo "installing .whl/ failed: FlashInfer will be reported absent"; return 1; }
    export PYTHONPATH=/tmp/site${PYTHONPATH:+:$PYTHONPATH}
}

# xgrammar (a raypaged dependency the machine lacks) from .whl/structured/ with pydantic and the apache-tvm-ffi it
# needs (>= 0.1.11, newer than FlashInfer's 0.1.6: kept apart, in its own folder, for the suites
# that use it).
use_xgrammar() {
    python3 -c "import xgrammar" 2>/dev/null && return 0
    ls .whl/structured/*.whl >/dev/null 2>&1 || { echo "no .whl/structured/: carry xgrammar's wheels"; return 1; }
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site-xgrammar \
        .whl/structured/*.whl || return 1
    export PYTHONPATH=/tmp/site-xgrammar${PYTHONPATH:+:$PYTHONPATH}
}

# Ray Serve's own dependencies (starlette, fastapi, uvicorn, opencensus, ...), which the bundle
# leaves out, from .device/serve/: each wheel whose distribution the machine lacks goes to /tmp/site.
use_serve_wheels() {
    ls .device/serve/*.whl >/dev/null 2>&1 || return 0
    local wheel dist missing=()
    for wheel in .device/serve/*.whl; do
        dist=$(basename "$wheel" | sed 's/-[0-9].*//; s/_/-/g')
        python3 -c "import importlib.metadata as m, sys; m.distribution(sys.argv[1])" "$dist" 2>/dev/null \
            || missing+=("$wheel")
    done
    [ ${#missing[@]} -eq 0 ] || python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site \
        "${missing[@]}"
}

RAY_READY=0
use_ray() {
    [ "$RAY_READY" = 1 ] && return 0
    if [ -f .device/setup.sh ]; then
        # shellcheck disable=SC1091
        source .device/setup.sh
    fi
    if ! python3 -c "import grpc_health, grpc_reflection" 2>/dev/null \
            && ls .device/grpcio_health_checking-*.whl >/dev/null 2>&1; then
        python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site \
            .device/grpcio_health_checking-*.whl .device/grpcio_reflection-*.whl
    fi
    python3 -c "import ray" 2>/dev/null || { echo "no Ray: carry .device/ (../shared/device/GPU.md)"; return 1; }
    use_serve_wheels
    RAY_READY=1
}

# Progress bars and Ray's chatter out of the log.
quiet() { grep --line-buffered -v "Loading weights\|it/s\]\|compiled_dag_node\|authentication_token"; }

bench() {  # suite timeout_s command...: run it under its timeout, log it, return its status
    local suite=$1 limit=$2
    shift 2
    echo "== $suite: $*"
    timeout -k 20 "$limit" "$@" 2>&1 | quiet | tee "$LOG_DIR/$suite.log"
    local rc=${PIPESTATUS[0]}
    echo "== $suite: exit $rc"
    return "$rc"
}

gpu_test_files() {  # the files holding GPU tests: collecting the whole suite would import Ray
    grep -rl --include="test_*.py" "mark.gpu" tests | sort
}

suite() {
    case $1 in
        tests) use_xgrammar; bench tests 540 python3 -m pytest -q -rf --tb=short -m gpu -p no:cacheprovider \
            -p no:warnings $(gpu_test_files) ;;
        tests-kernels) bench tests-kernels 540 python3 -m pytest -q -rf --tb=short -m gpu -p no:cacheprovider \
            -p no:warnings $(gpu_test_files | grep "^tests/kernels/") ;;
        tests-engine) use_xgrammar; bench tests-engine 540 python3 -m pytest -q -rf --tb=short -m gpu \
            -p no:cacheprovider -p no:warnings $(gpu_test_files | grep -v "^tests/kernels/") ;;
        kernels) use_wheels; bench kernels 450 python3 -m benchmarks.bench_kernels --out "$OUT_DIR" ;;
        decode) bench decode 300 python3 -m benchmarks.bench_decode --mode time --shape 8b --executors uni \
            --scheduling async --batch-sizes 1,8,64,256 --context 1024 --steps 50 --throughput-batch 8 \
            --prompt-len 64 --output-len 32 --out "$OUT_DIR" ;;
        decode-families) local shape status=0
            for shape in qwen3-8b gemma2-9b phi3-medium; do
            bench "decode-$shape" 180 python3 -m benchmarks.bench_decode --mode time --shape "$shape" \
                --executors uni --scheduling async --batch-sizes 1,64 --context 1024 --steps 50 \
                --throughput-batch 8 --prompt-len 64 --output-len 32 --out "$OUT_DIR" || status=1
            done
            return "$status" ;;
        trace) bench trace 200 python3 -m benchmarks.bench_decode --mode trace --shape 8b --scheduling async \
            --batch-sizes 1,64 --context 1024 --steps 30 --max-num-seqs 64 --max-num-batched-tokens 8192 \
            --out "$OUT_DIR" ;;
        phases) use_ray && bench phases 240 python3 -m benchmarks.bench_decode --mode phases --shape 8b \
            --executors uni,ray --scheduling sync --batch-sizes 1,64 --context 1024 --steps 30 --out "$OUT_DIR" ;;
        model) bench model 150 python3 -m benchmarks.bench_decode --mode model --shape 8b --batch-sizes 1,64 \
            --context 1024 --out "$OUT_DIR" ;;
        model-fp8) bench model-fp8 200 python3 -m benchmarks.bench_decode --mode model --shape 8b --batch-sizes 1,64 \
            --context 1024 --quantization fp8 --out "$OUT_DIR" ;;
        gemv) bench gemv 200 python3 -m benchmarks.bench_gemv --tune-rows "" --rows 1,16,64 --out "$OUT_DIR" ;;
        # The fused W8A8 kernel's sweep at every row bucket it may take (16 .. 256), the most
        # decisive (64: the batch-64 decode step) first, so that a cut run keeps those; the table
        # it writes comes back in $OUT (commit it to raypaged/kernels/configs/ for model-fp8).
        gemv-fp8) local table status
            table=$(python3 -c 'import torch; from raypaged.kernels.gemv_table import table_path
print(table_path(torch.cuda.get_device_name()))')
            bench gemv-fp8 540 python3 -m benchmarks.bench_gemv --fp8 --tune-rows 64,16,128,256,32,1 \
                --w8a16-tune-rows 1 --rows 1,16,32,64,128,256,512 --table "$table" --out "$OUT_DIR"
            status=$?
            [ -f "$table" ] && cp "$table" "$OUT_DIR/"
            return "$status" ;;
        quality) bench quality 540 python3 -m benchmarks.bench_quality --out "$OUT_DIR" ;;
        prefill) bench prefill 240 python3 -m benchmarks.bench_prefill_variants --out "$OUT_DIR" ;;
        throughput) bench throughput 420 python3 -m benchmarks.bench_throughput --shape 8b --num-requests 1000 \
            --max-total-len 2048 --max-num-seqs 512 --max-num-batched-tokens 8192 \
            --gpu-memory-utilization 0.85 --stats-every 8 --hf-requests 128 --hf-batch-size 128 \
            --hf-max-time 60 --out "$OUT_DIR" ;;
        throughput-fp8) bench throughput-fp8 360 python3 -m benchmarks.bench_throughput --shape 8b \
            --precisions bf16,fp8 --modes paged --num-requests 1000 --max-total-len 2048 --max-num-seqs 512 \
            --max-num-batched-tokens 8192 --gpu-memory-utilization 0.85 --stats-every 8 --hf-requests 0 \
            --out "$OUT_DIR" ;;
        # Where the FP8 step's time goes: each FP8 part alone and both beside bf16, 20 steps of
        # each run traced mid-run (kernels by family a step).
        throughput-fp8-steps) bench throughput-fp8-steps 540 python3 -m benchmarks.bench_throughput --shape 8b \
            --precisions bf16,fp8-weights,fp8-kv,fp8 --modes paged --num-requests 1000 --max-total-len 2048 \
            --max-num-seqs 512 --max-num-batched-tokens 8192 --gpu-memory-utilization 0.85 --stats-every 8 \
            --hf-requests 0 --profile-steps 20 --profile-from-step 300 --name 8b-fp8-steps --out "$OUT_DIR" ;;
        # 1M prompt and 1M output tokens a precision; fp8 first, the figure set beside the published one.
        throughput-fixed) bench throughput-fixed 560 python3 -m benchmarks.bench_throughput --shape 8b \
            --workload fixed --input-len 1000 --output-len 1000 --num-requests 1000 --precisions fp8,bf16 \
            --modes paged --max-num-seqs 512 --max-num-batched-tokens 8192 --gpu-memory-utilization 0.85 \
            --stats-every 8 --hf-requests 0 --out "$OUT_DIR" ;;
        reservation) bench reservation 480 python3 -m benchmarks.bench_throughput --shape 8b-32k \
            --num-requests 1000 --max-total-len 2048 --max-num-seqs 512 --max-num-batched-tokens 8192 \
            --gpu-memory-utilization 0.85 --stats-every 8 --hf-requests 0 --out "$OUT_DIR" ;;
        kvcapacity) bench kvcapacity 560 python3 -m benchmarks.bench_throughput --shape 8b \
            --kv-capacity auto,fp8 --capacity-context 8192 --max-num-seqs 512 \
            --max-num-batched-tokens 8192 --gpu-memory-utilization 0.85 --out "$OUT_DIR" ;;
        serving) use_ray && bench serving 560 python3 -m benchmarks.bench_serving --shape 8b --rates 24,40,56 \
            --num-requests 1000 --warmup-rate-requests 200 --max-total-len 2048 --stop-ttft-s 10 \
            --mode-budget-s 200 --out "$OUT_DIR" -- --max-model-len 8192 --max-num-seqs 512 \
            --max-num-batched-tokens 8192 --gpu-memory-utilization 0.85 ;;
        # Conversations begun at 2 / 4 / 8 a second for 25 s each (rate x 25 of them): ~1,020 reply
        # tokens a conversation, so 8 a second asks about the ~9k output tok/s the serving suite
        # saturated at, with longer contexts; without the cache every turn prefills its whole
        # history (~7,100 tokens a conversation), which should put that mode's knee lower. Each
        # mode's budget leaves room for a slow last rate under the 560 s.
        serving-multiturn) use_ray && bench serving-multiturn 560 python3 -m benchmarks.bench_serving --shape 8b \
            --trace multiturn --rates 2,4,8 --arrival-window-s 15 --system-prompt-len 500 --user-turn-mean 100 \
            --reply-mean 200 --turns 3,8 --think-time-s 1 --max-total-len 4096 --stop-ttft-s 10 \
            --mode-budget-s 200 --warmup-rate-requests 20 --out "$OUT_DIR" -- --max-model-len 8192 --max-num-seqs 512 \
            --max-num-batched-tokens 8192 --gpu-memory-utilization 0.85 ;;
        # 6,000 blocks a replica (96k tokens): the conversations' ~240k tokens of reusable KV
        # overflow one replica's pool, so where a history lands decides whether it is still cached.
        serving-multitenant) use_ray && bench serving-multitenant 560 python3 -m benchmarks.bench_serving --shape 8b \
            --trace multitenant --rates 4 --arrival-window-s 15 --system-prompts 8 --system-prompt-len 1000 \
            --user-turn-mean 100 --reply-mean 200 --turns 3,8 --think-time-s 1 --max-total-len 4096 \
            --num-kv-blocks 6000 --stop-ttft-s 10 --mode-budget-s 130 --warmup-rate-requests 8 --out "$OUT_DIR" \
            -- --max-model-len 8192 --max-num-seqs 256 --max-num-batched-tokens 8192 --gpu-memory-utilization 0.45 ;;
        # The host tier (issue 25): at 128 KiB of KV a token, the ~60 conversations of a 15 s window
        # reuse ~50 GiB, 3-4x the 7,500-block pool; the host tier holds the rest.
        serving-host-tier|serving-swap)
            local modes=prefix-cache,host-tier rates=2,4 name=8b-host-tier_h200
            [ "$1" = serving-swap ] && modes=host-tier,host-tier-swap rates=4,8 name=8b-swap_h200
            use_ray && bench "$1" 560 python3 -m benchmarks.bench_serving --shape 8b \
            --trace multiturn --modes "$modes" --rates "$rates" --arrival-window-s 15 --system-prompt-len 500 \
            --user-turn-mean 100 --reply-mean 200 --turns 3,8 --think-time-s 1 --max-total-len 4096 \
            --num-kv-blocks 7500 --kv-offload-size 48 --stop-ttft-s 10 --mode-budget-s 250 \
            --warmup-rate-requests 20 --name "$name" --out "$OUT_DIR" -- --max-model-len 8192 --max-num-seqs 512 \
            --max-num-batched-tokens 8192 --gpu-memory-utilization 0.85 ;;
        channel) use_ray && bench channel 90 python3 -m benchmarks.bench_ray_channel --gpu --out "$OUT_DIR" ;;
        staging) bench staging 60 python3 -m benchmarks.bench_staging ;;
        sampler) bench sampler 120 python3 -m benchmarks.bench_sampler --out "$OUT_DIR" ;;
        structured) use_xgrammar && bench structured 300 python3 -m benchmarks.bench_structured --shape 8b \
            --batch 64 --context 512 --steps 50 --schemas 200 --stream 2000 --out "$OUT_DIR" ;;
        tp) use_ray && bench tp 300 python3 -m benchmarks.bench_tp --shape 8b --tp-sizes 1,2 --batch-sizes 1,64 \
            --context 1024 --decode-steps 30 --throughput-batch 256 --prompt-len 512 --output-len 256 \
            --profile-steps 20 --out "$OUT_DIR" ;;
        faults) use_ray && bench faults 240 python3 -m benchmarks.bench_faults --out "$OUT_DIR" ;;
        # CUDA state, graphs and the KV pool rebuilt after each fault; fp32 so that the reference
        # run's greedy tokens do not hang on bf16 near-ties between batch compositions.
        chaos) use_ray && bench chaos 560 python3 -m benchmarks.chaos --num-calls 400 --concurrency 16 \
            --faults 3 --name "$(python3 -c 'from benchmarks.lib.common import device_tag; print(device_tag())')" \
            --out "$OUT_DIR" -- --dtype float32 --max-num-seqs 64 ;;
    esac
}
SUITES=" ${ONE_GPU[*]} tests-kernels tests-engine tp faults all "

[ $# -gt 0 ] || { sed -n '2,/^set -uo/p' "$0" | sed '$d'; exit 2; }
suites=()
for name in "$@"; do
    [[ $SUITES == *" $name "* ]] || { echo "unknown suite '$name'; suites:$SUITES"; exit 2; }
    if [ "$name" = all ]; then suites+=("${ONE_GPU[@]}"); else suites+=("$name"); fi
done
setup
failed=()
for name in "${suites[@]}"; do
    suite "$name" || failed+=("$name")
done
ls -l "$OUT_DIR"
[ ${#failed[@]} -eq 0 ] || { echo "failed: ${failed[*]}"; exit 1; }
