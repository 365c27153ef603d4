"""The paged prefill kernel's named launch configurations (raypaged/kernels/paged_prefill.py
VARIANTS), each checked against the torch reference and timed next to torch SDPA in one run.

    python -m benchmarks.bench_prefill_variants [--variants tma,baseline]     # scripts/gpu.sh prefill
    TRITON_INTERPRET=1 python -m benchmarks.bench_prefill_variants --dry-run   # CPU, toy sizes: a script check
    python -m benchmarks.bench_prefill_variants --replot benchmarks/results/prefill_variants_h200.json

Every variant is checked in bf16 on a varlen batch with cached prefixes (32 q / 8 kv heads, d 128,
block 16; then, while the run is under 125 s, d 64, block 32, GQA 8), and timed on one causal
4k / 8k-token prefill. q, k, v are views of one fused [T, Hq+2Hkv, D] buffer, as the model's QKV
projection leaves them. Warp-specialized variants run last (documented for Blackwell only: if one
takes the CUDA context down, the rest is measured already). The JSON is rewritten after every
step, so a run cut short keeps what it measured; the PNG and a table come last.
Writes prefill_variants_<device>.json and .png. The engine uses CUDA_DEFAULT only; the tests run
the other variants under -m slow.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch
import torch.nn.functional as F

from benchmarks.lib.common import add_replot_argument, device_tag, environment, replot
from raypaged.kernels.paged_prefill import CUDA_DEFAULT, VARIANTS, paged_prefill_triton
from raypaged.kernels.reference import paged_prefill_ref
from raypaged.kernels.testing import (
    check_against_reference,
    new_token_kv,
    query_start_loc,
    random_paged_batch,
    relative_error_per_row,
)

DTYPE, HQ, HKV, D, BS = torch.bfloat16, 32, 8, 128, 16
SECOND_SHAPE_BUDGET_S = 125


class Case:
    """A batch in the cache plus q/k/v as views of one fused buffer (sizes divided by `shrink`)."""

    def __init__(self, seq_lens: list[int], query_lens: list[int], hq: int, hkv: int, d: int, bs: int,
                 device: str, shrink: int) -> None:
        if shrink > 1:
            hq, hkv = hq // 4, max(1, hkv // 4)
        seq_lens = [max(1, n // shrink) for n in seq_lens]
        query_lens = [min(max(1, n // shrink), s) for n, s in zip(query_lens, seq_lens, strict=True)]
        self.batch = random_paged_batch(seq_lens, hkv, d, bs, DTYPE, device)
        k_new, v_new = new_token_kv(self.batch, query_lens)
        t = sum(query_lens)
        qkv = torch.empty((t, hq + 2 * hkv, d), dtype=DTYPE, device=device)
        qkv[:, :hq] = torch.randn((t, hq, d), device=device).to(DTYPE)
        qkv[:, hq:hq + hkv], qkv[:, hq + hkv:] = k_new, v_new
        self.q, self.k_new, self.v_new = qkv[:, :hq], qkv[:, hq:hq + hkv], qkv[:, hq + hkv:]
        b = self.batch
        self.args = (b.k_cache, b.v_cache, b.block_tables, query_start_loc(query_lens, device), b.seq_lens, d**-0.5)
        self.out = torch.empty_like(self.q)
        self._refs: dict = {}
        self.flops = self.sdpa_s = 0.0
        self.sdpa_out: torch.Tensor | None = None

    def run(self, name: str) -> torch.Tensor:
        return paged_prefill_triton(self.q, *self.args, out=self.out, k_new=self.k_new, v_new=self.v_new,
                                    variant=name)

    def ref(self, compute_dtype: torch.dtype) -> torch.Tensor:
        if compute_dtype not in self._refs:
            self._refs[compute_dtype] = paged_prefill_ref(self.q, *self.args, compute_dtype=compute_dtype)
        return self._refs[compute_dtype]


class Run:
    """The result being built, saved after every attempt."""

    def __init__(self, path: Path, dry: bool) -> None:
        self.path, self.start = path, time.time()
        self.result: dict = {"env": {"dry_run": True} if dry else environment(), "default_variant": CUDA_DEFAULT,
                             "variants": VARIANTS, "target_vs_sdpa": 0.8, "checks": {}, "timings": {},
                             "sdpa": {}, "errors": []}

    def save(self) -> None:
        self.result["elapsed_s"] = time.time() - self.start
        self.path.write_text(json.dumps(self.result, indent=1))

    def attempt(self, key: str, fn: Callable):
        """fn(), or None with the error recorded: a candidate that fails to compile or check."""
        try:
            return fn()
        except Exception as exc:  # noqa: BLE001 - recorded, and the other variants still run
            self.result["errors"].append(f"{key}: {type(exc).__name__}: {str(exc)[:300]}")
            print("FAILED", self.result["errors"][-1], flush=True)
            return None
        finally:
            self.save()


def make_bench(dry: bool) -> Callable:
    if not dry:
        from triton.testing import do_bench

        return lambda fn: do_bench(fn, warmup=25, rep=150, return_mode="median") / 1e3

    def once(fn: Callable) -> float:
        start = time.perf_counter()
        fn()
        return time.perf_counter() - start
    return once


def measure(run: Run, names: list[str], sizes: tuple[int, ...], device: str, shrink: int, dry: bool) -> None:
    bench = make_bench(dry)
    checks = {  # fresh + chunked + prefix hits + 1-token requests, two head/page/GQA shapes
        "varlen_d128_bs16_g4": Case([1, 17, 700, 2100, 1500, 4096], [1, 17, 300, 2100, 77, 1000],
                                    HQ, HKV, D, BS, device, shrink),
        "varlen_d64_bs32_g8": Case([513, 33, 1900, 260], [513, 32, 640, 1], 32, 4, 64, 32, device, shrink),
    }
    timed: dict[int, Case] = {}
    for tokens in sizes:
        case = timed[tokens] = Case([tokens * shrink], [tokens * shrink], HQ, HKV, D, BS, device, shrink)
        q4 = case.q.transpose(0, 1).unsqueeze(0).contiguous()
        k4 = case.k_new.transpose(0, 1).unsqueeze(0).contiguous()
        v4 = case.v_new.transpose(0, 1).unsqueeze(0).contiguous()
        kx, vx = (t.repeat_interleave(q4.shape[1] // t.shape[1], 1) for t in (k4, v4))
        fns = {"enable_gqa": lambda q4=q4, k4=k4, v4=v4: F.scaled_dot_product_attention(
                   q4, k4, v4, is_causal=True, scale=D**-0.5, enable_gqa=True),
               "expanded_kv": lambda q4=q4, kx=kx, vx=vx: F.scaled_dot_product_attention(
                   q4, kx, vx, is_causal=True, scale=D**-0.5)}
        flops = 4 * q4.shape[1] * D * tokens * (tokens + 1) / 2
        sdpa = {k: run.attempt(f"sdpa {tokens} {k}", lambda f=f: bench(f)) for k, f in fns.items()}
        best = min(s for s in sdpa.values() if s)
        case.sdpa_out = fns["enable_gqa"]()[0].transpose(0, 1)
        run.result["sdpa"][tokens] = {"variants_s": sdpa, "seconds": best, "TFLOPs": flops / best / 1e12}
        case.flops, case.sdpa_s = flops, best

    def check(name: str, key: str) -> float:
        case = checks[key]
        return check_against_reference(case.run(name).clone(), case.ref, DTYPE)

    def time_one(name: str, tokens: int) -> dict:
        case = timed[tokens]
        err_sdpa = relative_error_per_row(case.run(name), case.sdpa_out).max().item()
        seconds = bench(lambda: case.run(name))
        return {"seconds": seconds, "TFLOPs": case.flops / seconds / 1e12, "vs_sdpa": case.sdpa_s / seconds,
                "max_rel_err_vs_sdpa": err_sdpa}

    result = run.result
    for name in names:
        err = run.attempt(f"{name} check", lambda name=name: check(name, "varlen_d128_bs16_g4"))
        result["checks"].setdefault(name, {})["varlen_d128_bs16_g4"] = err
        if err is None:
            continue
        for tokens in sizes:
            row = run.attempt(f"{name} time {tokens}", lambda name=name, tokens=tokens: time_one(name, tokens))
            result["timings"].setdefault(name, {})[tokens] = row
            if row:
                print(f"  {name:>16} {tokens:>5} tok {row['TFLOPs']:6.1f} TFLOP/s x{row['vs_sdpa']:.3f} SDPA  "
                      f"[{time.time() - run.start:.0f}s]", flush=True)
    for name in names:
        if name in result["checks"] and time.time() - run.start < SECOND_SHAPE_BUDGET_S:
            result["checks"][name]["varlen_d64_bs32_g8"] = run.attempt(
                f"{name} check d64", lambda name=name: check(name, "varlen_d64_bs32_g8"))


def print_table(result: dict, sizes: tuple[int, ...]) -> None:
    print("\nSDPA: " + ", ".join(f"{t} tok {r['TFLOPs']:.0f} TFLOP/s" for t, r in result["sdpa"].items()))
    print(f"{'variant':>16} {'4k TFLOP/s':>11} {'x SDPA':>7} {'8k TFLOP/s':>11} {'x SDPA':>7}  checks")
    ranked = sorted(result["timings"].items(), key=lambda kv: -min((r or {}).get("vs_sdpa", 0) for r in kv[1].values()))
    for name, rows in ranked:
        cells = "".join(f" {r['TFLOPs']:>11.1f} {r['vs_sdpa']:>7.3f}" if r else f" {'-':>11} {'-':>7}"
                        for r in (rows.get(sizes[0]), rows.get(sizes[-1])))
        ok = ",".join(f"{k.split('_')[1]}:{'ok' if v is not None else 'FAIL'}"
                      for k, v in result["checks"].get(name, {}).items())
        print(f"{name:>16}{cells}  {ok}{'  (default)' if name == CUDA_DEFAULT else ''}")
    for error in result["errors"]:
        print("ERROR", error)


def plot(run: dict, path: Path) -> None:
    """TFLOP/s of every variant at each size, beside SDPA and the 0.8x SDPA target of that run."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    sizes = sorted(run["sdpa"], key=int)
    timed = [v for v in run["timings"] if all(run["timings"][v].get(s) for s in sizes)]
    variants = sorted(timed, key=lambda v: -run["timings"][v][sizes[0]]["TFLOPs"])
    fig, ax = plt.subplots(figsize=(9, 4.5))
    width = 0.8 / len(sizes)
    for k, size in enumerate(sizes):
        values = [run["timings"][v][size]["TFLOPs"] for v in variants]
        ax.bar([i + k * width for i in range(len(variants))], values, width, label=f"{int(size):,} tokens")
        sdpa = run["sdpa"][size]["TFLOPs"]
        ax.hlines([sdpa, 0.8 * sdpa], -0.5, len(variants), colors=f"C{k}", linestyles=["-", ":"], linewidth=1)
    ax.set_xticks([i + width * (len(sizes) - 1) / 2 for i in range(len(variants))])

    def label(v: str) -> str:
        if v == CUDA_DEFAULT:
            return f"{v} (default)"
        return f"{v} (default in that run)" if v == run.get("default_variant") else v

    ax.set_xticklabels([label(v) for v in variants], rotation=30, ha="right")
    ax.set_ylabel("TFLOP/s (causal, bf16, 32 q / 8 kv heads, d 128)")
    env = run["env"]
    ax.set_title(f"paged prefill variants on the {env.get('device', 'cpu')} ({env.get('commit')}); "
                 "lines: SDPA (solid), 0.8x SDPA (dotted)", fontsize=9)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--variants", default="", help="comma list of VARIANTS names (default: all)")
    parser.add_argument("--dry-run", action="store_true", help="CPU interpreter, toy sizes: checks the script")
    parser.add_argument("--out", type=Path, default=Path(__file__).resolve().parent / "results")
    add_replot_argument(parser)
    args = parser.parse_args(argv)
    if args.replot is not None:
        return replot(args.replot, plot)
    if args.dry_run and os.environ.get("TRITON_INTERPRET") != "1":
        parser.error("--dry-run runs the kernels under the interpreter: set TRITON_INTERPRET=1")
    names = [v for v in args.variants.split(",") if v] or list(VARIANTS)
    names = ([n for n in names if not VARIANTS[n].get("warp_specialize")]
             + [n for n in names if VARIANTS[n].get("warp_specialize")])
    sizes, shrink, device = ((128, 256), 8, "cpu") if args.dry_run else ((4096, 8192), 1, "cuda")
    torch.manual_seed(0)
    args.out.mkdir(parents=True, exist_ok=True)
    run = Run(args.out / f"prefill_variants_{'dry_run' if args.dry_run else device_tag()}.json", args.dry_run)
    print(run.result["env"], flush=True)
    measure(run, names, sizes, device, shrink, args.dry_run)
    run.save()
    print_table(run.result, sizes)
    plot(json.loads(run.path.read_text()), run.path.with_suffix(".png"))
    print(f"elapsed {time.time() - run.start:.0f}s; wrote {run.path} and {run.path.with_suffix('.png').name}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
