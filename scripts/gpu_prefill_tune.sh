#!/usr/bin/env bash
# Prefill kernel candidates on the GPU machine (the `run` tool), from the repository root:
#   RAYPAGED_COMMIT=<sha> bash scripts/gpu_prefill_tune.sh [variant,variant,...]
# Every entry of raypaged/kernels/paged_prefill.py VARIANTS (or the ones named) is checked in bf16
# against the torch reference on a varlen batch with cached prefixes (32 q / 8 kv heads, d 128,
# block 16; then d 64, block 32, GQA 8), and timed on one causal 4k / 8k-token prefill next to
# torch SDPA in the same run. q, k, v are views of one fused [T, Hq+2Hkv, D] buffer, as the
# model's QKV projection leaves them. Writes kernels_h200_tune_prefill2.json (after every step,
# so a timeout keeps what was measured) and prints a table. Budget: under 3 minutes.
# TUNE_DRY_RUN=1 runs the same logic on CPU under the interpreter at toy sizes (script check).
set -uo pipefail
cd "$(dirname "$0")/.."
export PYTHONUNBUFFERED=1
OUT_DIR=${OUT:-benchmarks/results}
mkdir -p "$OUT_DIR"

if [ -n "${TUNE_DRY_RUN:-}" ]; then
    export TRITON_INTERPRET=1
else
    export TRITON_INTERPRET=0
    nvidia-smi --query-gpu=name,clocks.sm,clocks.mem --format=csv,noheader
    python3 -m pip install -q --no-deps --no-build-isolation -e . >"$OUT_DIR/pip.log" 2>&1 \
        || { cat "$OUT_DIR/pip.log"; exit 1; }
fi

timeout 150 python3 - "$OUT_DIR" "${1:-}" <<'EOF'
import json, os, sys, time
from pathlib import Path

import torch
import torch.nn.functional as F
from triton.testing import do_bench

sys.path.insert(0, "benchmarks")
from bench_kernels import environment  # commit (RAYPAGED_COMMIT), device, versions
from raypaged.kernels.paged_prefill import CUDA_DEFAULT, VARIANTS, paged_prefill_triton
from raypaged.kernels.reference import paged_prefill_ref
from raypaged.kernels.testing import (check_against_reference, new_token_kv, query_start_loc,
                                      random_paged_batch, relative_error_per_row)

out_dir, only = Path(sys.argv[1]), [v for v in sys.argv[2].split(",") if v]
names = only or list(VARIANTS)
# Warp specialization is documented for Blackwell only: run it last, so that if it takes the
# CUDA context down everything else is already measured.
names = [n for n in names if not VARIANTS[n].get("warp_specialize")] + \
        [n for n in names if VARIANTS[n].get("warp_specialize")]
DTYPE, HQ, HKV, D, BS = torch.bfloat16, 32, 8, 128, 16
DRY = bool(os.environ.get("TUNE_DRY_RUN"))
DEVICE = "cpu" if DRY else "cuda"
SIZES = (128, 256) if DRY else (4096, 8192)
SHRINK = 8 if DRY else 1  # the check batches' lengths are divided by this in a dry run
if DRY:
    def do_bench(fn, warmup, rep, return_mode):
        t0 = time.perf_counter(); fn(); return (time.perf_counter() - t0) * 1e3
start = time.time()
torch.manual_seed(0)
result = {"env": {"dry_run": True} if DRY else environment(), "default_variant": CUDA_DEFAULT, "variants": VARIANTS,
          "target_vs_sdpa": 0.8, "checks": {}, "timings": {}, "sdpa": {}, "errors": []}
json_path = out_dir / "kernels_h200_tune_prefill2.json"
print(result["env"], flush=True)


def save():
    result["elapsed_s"] = time.time() - start
    json_path.write_text(json.dumps(result, indent=1))


class Case:
    """A batch in the cache plus q/k/v as views of one fused buffer."""

    def __init__(self, seq_lens, query_lens, hq, hkv, d, bs):
        if DRY:
            hq, hkv = hq // 4, max(1, hkv // 4)
        seq_lens = [max(1, n // SHRINK) for n in seq_lens]
        query_lens = [min(max(1, n // SHRINK), s) for n, s in zip(query_lens, seq_lens)]
        self.batch = random_paged_batch(seq_lens, hkv, d, bs, DTYPE, DEVICE)
        k_new, v_new = new_token_kv(self.batch, query_lens)
        t = sum(query_lens)
        qkv = torch.empty((t, hq + 2 * hkv, d), dtype=DTYPE, device=DEVICE)
        qkv[:, :hq] = torch.randn((t, hq, d), device=DEVICE).to(DTYPE)
        qkv[:, hq:hq + hkv], qkv[:, hq + hkv:] = k_new, v_new
        self.q, self.k_new, self.v_new = qkv[:, :hq], qkv[:, hq:hq + hkv], qkv[:, hq + hkv:]
        b = self.batch
        self.args = (b.k_cache, b.v_cache, b.block_tables, query_start_loc(query_lens, DEVICE),
                     b.seq_lens, d**-0.5)
        self.out = torch.empty_like(self.q)
        self._refs = {}

    def run(self, name):
        return paged_prefill_triton(self.q, *self.args, out=self.out, k_new=self.k_new,
                                    v_new=self.v_new, variant=name)

    def ref(self, cd):
        if cd not in self._refs:
            self._refs[cd] = paged_prefill_ref(self.q, *self.args, compute_dtype=cd)
        return self._refs[cd]


def attempt(key, fn):
    try:
        return fn()
    except Exception as exc:  # a candidate that fails to compile or check is recorded
        result["errors"].append(f"{key}: {type(exc).__name__}: {str(exc)[:300]}")
        print("FAILED", result["errors"][-1], flush=True)
        return None
    finally:
        save()


checks = {  # fresh + chunked + prefix hits + 1-token requests, two head/page/GQA shapes
    "varlen_d128_bs16_g4": Case([1, 17, 700, 2100, 1500, 4096], [1, 17, 300, 2100, 77, 1000],
                                HQ, HKV, D, BS),
    "varlen_d64_bs32_g8": Case([513, 33, 1900, 260], [513, 32, 640, 1], 32, 4, 64, 32),
}
timed = {}
for tokens in SIZES:
    case = timed[tokens] = Case([tokens * SHRINK], [tokens * SHRINK], HQ, HKV, D, BS)
    q4 = case.q.transpose(0, 1).unsqueeze(0).contiguous()
    k4 = case.k_new.transpose(0, 1).unsqueeze(0).contiguous()
    v4 = case.v_new.transpose(0, 1).unsqueeze(0).contiguous()
    kx, vx = (t.repeat_interleave(q4.shape[1] // t.shape[1], 1) for t in (k4, v4))
    fns = {"enable_gqa": lambda: F.scaled_dot_product_attention(
               q4, k4, v4, is_causal=True, scale=D**-0.5, enable_gqa=True),
           "expanded_kv": lambda: F.scaled_dot_product_attention(
               q4, kx, vx, is_causal=True, scale=D**-0.5)}
    flops = 4 * q4.shape[1] * D * tokens * (tokens + 1) / 2
    sdpa = {k: attempt(f"sdpa {tokens} {k}", lambda f=f: do_bench(
        f, warmup=25, rep=150, return_mode="median") / 1e3) for k, f in fns.items()}
    best = min(s for s in sdpa.values() if s)
    case.sdpa_out = fns["enable_gqa"]()[0].transpose(0, 1)
    result["sdpa"][tokens] = {"variants_s": sdpa, "seconds": best, "TFLOPs": flops / best / 1e12}
    case.flops, case.sdpa_s = flops, best


def check(name, key):
    case = checks[key]
    return check_against_reference(case.run(name).clone(), case.ref, DTYPE)


def time_one(name, tokens):
    case = timed[tokens]
    err_sdpa = relative_error_per_row(case.run(name), case.sdpa_out).max().item()
    seconds = do_bench(lambda: case.run(name), warmup=25, rep=150, return_mode="median") / 1e3
    return {"seconds": seconds, "TFLOPs": case.flops / seconds / 1e12,
            "vs_sdpa": case.sdpa_s / seconds, "max_rel_err_vs_sdpa": err_sdpa}


for phase in ("main", "second_shape"):
    for name in names:
        if phase == "main":
            err = attempt(f"{name} check", lambda: check(name, "varlen_d128_bs16_g4"))
            result["checks"].setdefault(name, {})["varlen_d128_bs16_g4"] = err
            if err is None:
                continue
            for tokens in SIZES:
                row = attempt(f"{name} time {tokens}", lambda: time_one(name, tokens))
                result["timings"].setdefault(name, {})[tokens] = row
                if row:
                    print(f"  {name:>16} {tokens:>5} tok {row['TFLOPs']:6.1f} TFLOP/s "
                          f"x{row['vs_sdpa']:.3f} SDPA  [{time.time() - start:.0f}s]", flush=True)
        elif time.time() - start < 125:
            result["checks"][name]["varlen_d64_bs32_g8"] = attempt(
                f"{name} check d64", lambda: check(name, "varlen_d64_bs32_g8"))

save()
print(f"\nSDPA: " + ", ".join(f"{t} tok {r['TFLOPs']:.0f} TFLOP/s" for t, r in result["sdpa"].items()))
print(f"{'variant':>16} {'4k TFLOP/s':>11} {'x SDPA':>7} {'8k TFLOP/s':>11} {'x SDPA':>7}  checks")
ranked = sorted(result["timings"].items(),
                key=lambda kv: -min((r or {}).get("vs_sdpa", 0) for r in kv[1].values()))
for name, rows in ranked:
    cells = "".join(f" {r['TFLOPs']:>11.1f} {r['vs_sdpa']:>7.3f}" if r else f" {'-':>11} {'-':>7}"
                    for r in (rows.get(SIZES[0]), rows.get(SIZES[1])))
    ok = ",".join(f"{k.split('_')[1]}:{'ok' if v is not None else 'FAIL'}"
                  for k, v in result["checks"].get(name, {}).items())
    print(f"{name:>16}{cells}  {ok}{'  (default)' if name == CUDA_DEFAULT else ''}")
for e in result["errors"]:
    print("ERROR", e)
print(f"elapsed {time.time() - start:.0f}s; wrote {json_path}")
EOF
rc=$?
echo "tune rc=$rc"
exit $rc
