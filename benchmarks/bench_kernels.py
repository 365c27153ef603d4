"""Paged-attention kernels on a GPU: check correctness, then time against the card's ceilings.

    python -m benchmarks.bench_kernels [--tune decode,prefill] [--out DIR]

Decode (32 q / 8 kv heads, head dim 128, bf16, block 16) at (batch, context) in DECODE_CASES:
achieved bandwidth = bytes that must move (K and V of every context token once, q and out once,
block table) / time, against a device-to-device copy measured in the same run (read + write
bytes / time), against torch SDPA on contiguous KV and against the same Triton kernel on
contiguous KV (identity block table). Decode launches are timed as CUDA-graph replays (as a
server runs them), rotating over enough distinct batches that the working set is >= 4x L2.
Prefill: TFLOP/s of causal attention over 4k and 8k fresh tokens, against SDPA; the kernel gets
the step's own k/v as the attention layer passes them (paged_prefill.CUDA_DEFAULT decides the path).

--tune decode,prefill also sweeps tile sizes, warps, stages (and split counts) and records every
timing.
Writes kernels_<device>.json and .png under --out; prints a table last.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import platform
import subprocess
import sys
from pathlib import Path

import torch
import torch.nn.functional as F
import triton
from triton.testing import do_bench

from benchmarks.lib import common
from benchmarks.lib.common import L2_BYTES, graph_time, log
from raypaged.kernels.paged_decode import (
    choose_num_splits,
    default_launch_config,
    paged_decode_triton,
)
from raypaged.kernels.paged_prefill import CUDA_DEFAULT as PREFILL_VARIANT
from raypaged.kernels.paged_prefill import (
    default_launch_config as prefill_launch_config,
)
from raypaged.kernels.paged_prefill import paged_prefill_triton
from raypaged.kernels.reference import paged_decode_ref, paged_prefill_ref
from raypaged.kernels.testing import (
    check_against_reference,
    query_start_loc,
    random_paged_batch,
)
from raypaged.kernels.triton_common import num_sms

DECODE_CASES = [(1, 32768), (8, 8192), (64, 4096), (256, 1024)]
PREFILL_TOKENS = [4096, 8192]
NUM_Q_HEADS, NUM_KV_HEADS, HEAD_DIM, BLOCK_SIZE = 32, 8, 128, 16
DTYPE = torch.bfloat16
SCALE = HEAD_DIM**-0.5
TARGETS = {"decode_64x4096_frac_copy": 0.90, "decode_1x32768_frac_copy": 0.75,
           "paging_cost_max": 0.03, "prefill_vs_sdpa_min": 0.8}


def copy_bandwidth() -> float:
    """Bytes read + written per second by a 1 GiB device-to-device copy (common.copy_bandwidth)."""
    return common.copy_bandwidth(torch.device("cuda"))


class DecodeCase:
    """One (batch, context) point: paged and contiguous pools, SDPA tensors, rotating variants."""

    def __init__(self, batch: int, context: int, layout: str = "separate"):
        self.batch, self.context = batch, context
        kv_bytes = 2 * batch * context * NUM_KV_HEADS * HEAD_DIM * DTYPE.itemsize
        self.variants = max(1, math.ceil(4 * L2_BYTES / kv_bytes))
        lens = [context] * (batch * self.variants)
        self.paged = random_paged_batch(lens, NUM_KV_HEADS, HEAD_DIM, BLOCK_SIZE, DTYPE, "cuda",
                                        pool_factor=4, layout=layout)
        self.q = torch.randn((len(lens), NUM_Q_HEADS, HEAD_DIM), dtype=DTYPE, device="cuda")
        self.out = torch.empty_like(self.q)
        self.bytes = (kv_bytes + 2 * batch * NUM_Q_HEADS * HEAD_DIM * DTYPE.itemsize
                      + batch * math.ceil(context / BLOCK_SIZE) * 4 + batch * 4)

    def rows(self, i: int) -> slice:
        return slice(i * self.batch, (i + 1) * self.batch)

    def run_paged(self, batch, i: int, **config):
        r = self.rows(i)
        return paged_decode_triton(self.q[r], batch.k_cache, batch.v_cache, batch.block_tables[r],
                                   batch.seq_lens[r], SCALE, out=self.out[r],
                                   max_seq_len=self.context, **config)

    def check(self, batch, **config) -> float:
        r = self.rows(0)
        out = self.run_paged(batch, 0, **config).clone()
        args = (batch.k_cache, batch.v_cache, batch.block_tables[r], batch.seq_lens[r], SCALE)
        return check_against_reference(
            out, lambda cd: paged_decode_ref(self.q[r], *args, compute_dtype=cd), DTYPE
        )

    def time_paged(self, batch, **config) -> float:
        return graph_time(lambda i: self.run_paged(batch, i, **config), self.variants)


def bench_decode(case: DecodeCase, copy_bw: float, tune: bool) -> dict:
    b, ctx = case.batch, case.context
    splits = choose_num_splits(b, NUM_KV_HEADS, ctx, num_sms(torch.device("cuda")))
    row = {"batch": b, "context": ctx, "bytes": case.bytes, "num_splits": splits,
           "config": default_launch_config(HEAD_DIM, DTYPE)}
    row["max_rel_err"] = case.check(case.paged)

    contiguous = random_paged_batch([ctx] * b * case.variants, NUM_KV_HEADS, HEAD_DIM, BLOCK_SIZE,
                                    DTYPE, "cuda", pool_factor=1, contiguous=True)
    row["contiguous_max_rel_err"] = case.check(contiguous)
    # SDPA on contiguous [B, Hkv, ctx, D], two ways, the faster one is the baseline: the query
    # heads of a KV head as its query rows, or one query row per head with enable_gqa (which
    # lets the flash backend split the context for small batches).
    keys = torch.stack(contiguous.keys).transpose(1, 2).contiguous()
    values = torch.stack(contiguous.values).transpose(1, 2).contiguous()
    contiguous.keys = contiguous.values = []
    group = NUM_Q_HEADS // NUM_KV_HEADS

    def sdpa_folded(i: int) -> torch.Tensor:
        r = case.rows(i)
        q4 = case.q[r].view(b, NUM_KV_HEADS, group, HEAD_DIM)
        return F.scaled_dot_product_attention(q4, keys[r], values[r], scale=SCALE).reshape(
            b, NUM_Q_HEADS, HEAD_DIM)

    def sdpa_enable_gqa(i: int) -> torch.Tensor:
        r = case.rows(i)
        q4 = case.q[r].view(b, NUM_Q_HEADS, 1, HEAD_DIM)
        return F.scaled_dot_product_attention(q4, keys[r], values[r], scale=SCALE,
                                              enable_gqa=True).reshape(b, NUM_Q_HEADS, HEAD_DIM)

    r0 = case.rows(0)
    args = (contiguous.k_cache, contiguous.v_cache, contiguous.block_tables[r0], contiguous.seq_lens[r0], SCALE)
    row["sdpa_variants_s"], row["sdpa_max_rel_err"] = {}, 0.0
    for name, fn in [("folded_gqa", sdpa_folded), ("enable_gqa", sdpa_enable_gqa)]:
        try:
            err = check_against_reference(
                fn(0), lambda cd: paged_decode_ref(case.q[r0], *args, compute_dtype=cd), DTYPE)
            row["sdpa_max_rel_err"] = max(row["sdpa_max_rel_err"], err)
            row["sdpa_variants_s"][name] = graph_time(fn, case.variants)
        except Exception as exc:  # noqa: BLE001
            row["sdpa_variants_s"][name] = f"{type(exc).__name__}: {str(exc)[:200]}"

    row["paged_s"] = case.time_paged(case.paged)
    row["contiguous_s"] = case.time_paged(contiguous)
    row["sdpa_s"] = min(t for t in row["sdpa_variants_s"].values() if isinstance(t, float))
    row["paged_repeat_s"] = case.time_paged(case.paged)  # the spread between two timings = noise
    for name in ("paged", "contiguous", "sdpa"):
        row[f"{name}_TBps"] = case.bytes / row[f"{name}_s"] / 1e12
        row[f"{name}_frac_copy"] = case.bytes / row[f"{name}_s"] / copy_bw
    row["paging_cost"] = row["paged_s"] / row["contiguous_s"] - 1
    if tune:
        row["sweep"] = sweep_decode(case, splits)
    keys = values = contiguous = None  # the contiguous copies go before the next case
    return row


def sweep_decode(case: DecodeCase, splits: int) -> list[dict]:
    results = []
    for tile_n in (32, 64, 128):
        for num_warps in (4, 8):
            for num_stages in (2, 3, 4):
                config = {"tile_n": tile_n, "num_warps": num_warps, "num_stages": num_stages,
                              "num_splits": splits}
                results.append(time_config(case, config))
    best = min(results, key=lambda r: r.get("seconds", math.inf))
    for factor in (0.25, 0.5, 2, 4):
        n = int(splits * factor)
        if 1 <= n <= 128 and n != splits:
            results.append(time_config(case, {**best["config"], "num_splits": n}))
    return results


def time_config(case: DecodeCase, config: dict) -> dict:
    try:
        case.check(case.paged, **config)
        seconds = graph_time(lambda i: case.run_paged(case.paged, i, **config), case.variants,
                             calls=10, replays=10)
        return {"config": config, "seconds": seconds, "TBps": case.bytes / seconds / 1e12}
    except Exception as exc:  # noqa: BLE001 - a config that fails to compile or to fit is recorded, not fatal
        return {"config": config, "error": f"{type(exc).__name__}: {str(exc)[:200]}"}


def bench_prefill(tokens: int, tune: bool) -> dict:
    batch = random_paged_batch([tokens], NUM_KV_HEADS, HEAD_DIM, BLOCK_SIZE, DTYPE, "cuda")
    q = torch.randn((tokens, NUM_Q_HEADS, HEAD_DIM), dtype=DTYPE, device="cuda")
    args = (batch.k_cache, batch.v_cache, batch.block_tables, query_start_loc([tokens], "cuda"),
            batch.seq_lens, SCALE)
    flops = 4 * NUM_Q_HEADS * HEAD_DIM * tokens * (tokens + 1) / 2  # two matmuls, causal half
    # The step's own k/v, as the attention layer passes them: the default config decides
    # whether the new tokens are read from them or through the block table.
    step_kv = {"k_new": batch.keys[0], "v_new": batch.values[0]}
    row = {"tokens": tokens, "flops": flops, "variant": PREFILL_VARIANT,
           "config": prefill_launch_config(HEAD_DIM, DTYPE, q.device)}
    row["max_rel_err"] = check_against_reference(
        paged_prefill_triton(q, *args, **step_kv),
        lambda cd: paged_prefill_ref(q, *args, compute_dtype=cd), DTYPE)
    out = torch.empty_like(q)
    row["triton_s"] = do_bench(lambda: paged_prefill_triton(q, *args, out=out, **step_kv),
                               warmup=50, rep=400, return_mode="median") / 1e3

    q4 = q.transpose(0, 1).unsqueeze(0).contiguous()  # [1, Hq, T, D]
    k4 = torch.stack(batch.keys).permute(0, 2, 1, 3).contiguous()  # [1, Hkv, T, D]
    v4 = torch.stack(batch.values).permute(0, 2, 1, 3).contiguous()
    group = NUM_Q_HEADS // NUM_KV_HEADS
    k_full, v_full = k4.repeat_interleave(group, 1), v4.repeat_interleave(group, 1)
    sdpa_variants = {
        "expanded_kv": lambda: F.scaled_dot_product_attention(q4, k_full, v_full, is_causal=True, scale=SCALE),
        "enable_gqa": lambda: F.scaled_dot_product_attention(q4, k4, v4, is_causal=True, scale=SCALE,
                                                             enable_gqa=True),
    }
    row["sdpa_variants_s"] = {}
    for name, fn in sdpa_variants.items():
        try:
            row["sdpa_variants_s"][name] = do_bench(fn, warmup=50, rep=400, return_mode="median") / 1e3
        except Exception as exc:  # noqa: BLE001
            row["sdpa_variants_s"][name] = f"{type(exc).__name__}: {str(exc)[:200]}"
    timings = [t for t in row["sdpa_variants_s"].values() if isinstance(t, float)]
    row["sdpa_s"] = min(timings)  # the faster SDPA variant is the baseline
    row["triton_TFLOPs"] = flops / row["triton_s"] / 1e12
    row["sdpa_TFLOPs"] = flops / row["sdpa_s"] / 1e12
    row["vs_sdpa"] = row["sdpa_s"] / row["triton_s"]
    if tune:
        row["sweep"] = []
        for block_m, block_n, num_warps, num_stages, pack_gqa in [
            (128, 128, 8, 3, False), (128, 64, 4, 3, False), (128, 64, 4, 4, False),
            (128, 32, 4, 4, False), (128, 64, 4, 2, False), (64, 128, 4, 3, False),
            (128, 128, 8, 3, True), (128, 64, 8, 3, True), (128, 64, 4, 3, True),
            (64, 64, 4, 3, True), (128, 32, 4, 4, True), (256, 64, 8, 2, True),
        ]:
            config = {"block_m": block_m, "block_n": block_n, "num_warps": num_warps,
                          "num_stages": num_stages, "pack_gqa": pack_gqa}
            try:
                check_against_reference(paged_prefill_triton(q, *args, **step_kv, **config),
                                        lambda cd: paged_prefill_ref(q, *args, compute_dtype=cd), DTYPE)
                seconds = do_bench(lambda config=config: paged_prefill_triton(q, *args, out=out, **step_kv, **config),
                                   warmup=25, rep=150, return_mode="median") / 1e3
                row["sweep"].append({"config": config, "seconds": seconds, "TFLOPs": flops / seconds / 1e12})
            except Exception as exc:  # noqa: BLE001
                row["sweep"].append({"config": config, "error": f"{type(exc).__name__}: {str(exc)[:200]}"})
            log("  prefill", tokens, row["sweep"][-1])
    return row


def bench_head_major(copy_bw: float) -> list[dict]:
    """The same decode on a head-major pool ([blocks, Hkv, B, D] storage), same kernel."""
    rows = []
    for b, ctx in [(1, 32768), (64, 4096)]:
        case = DecodeCase(b, ctx, layout="head_major")
        case.check(case.paged)
        seconds = case.time_paged(case.paged)
        rows.append({"batch": b, "context": ctx, "seconds": seconds,
                     "TBps": case.bytes / seconds / 1e12, "frac_copy": case.bytes / seconds / copy_bw})
        del case
    return rows


def environment() -> dict:
    commit = os.environ.get("RAYPAGED_COMMIT")
    if not commit:
        try:
            commit = subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True, text=True,
                                    check=True).stdout.strip()
        except (OSError, subprocess.CalledProcessError):
            commit = "unknown"
    props = torch.cuda.get_device_properties(0)
    return {"commit": commit, "device": props.name, "sm_count": props.multi_processor_count,
            "torch": torch.__version__, "triton": triton.__version__, "cuda": torch.version.cuda,
            "python": platform.python_version()}


def plot(result: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(13, 4.5), gridspec_kw={"width_ratios": [3, 1]})
    rows = result["decode"]
    labels = [f"B{r['batch']}\nctx {r['context']}" for r in rows]
    width = 0.27
    for k, (key, name) in enumerate([("paged", "Triton, paged"), ("contiguous", "Triton, contiguous"),
                                     ("sdpa", "torch SDPA, contiguous")]):
        xs = [i + (k - 1) * width for i in range(len(rows))]
        ax1.bar(xs, [r[f"{key}_TBps"] for r in rows], width, label=name)
    ax1.axhline(result["copy_TBps"], color="k", ls="--", lw=1, label=f"copy {result['copy_TBps']:.2f} TB/s")
    ax1.set_xticks(range(len(rows)), labels)
    ax1.set_ylabel("achieved bandwidth (TB/s)")
    ax1.set_title(f"paged decode, bf16, 32q/8kv heads, d128, block 16 — {result['env']['device']}")
    ax1.legend(loc="lower right", fontsize=8)
    pre = result["prefill"]
    xs = range(len(pre))
    ax2.bar([x - 0.2 for x in xs], [r["triton_TFLOPs"] for r in pre], 0.4, label="Triton, paged")
    ax2.bar([x + 0.2 for x in xs], [r["sdpa_TFLOPs"] for r in pre], 0.4, label="torch SDPA")
    ax2.set_xticks(list(xs), [f"{r['tokens']} tok" for r in pre])
    ax2.set_ylabel("TFLOP/s")
    ax2.set_title("causal prefill")
    ax2.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tune", default="", help="sweep launch configs of: decode,prefill")
    parser.add_argument("--out", type=Path, default=Path("benchmarks/results"))
    parser.add_argument("--sections", default="decode,prefill,head_major",
                        help="which measurements to run (all by default)")
    parser.add_argument("--decode-cases", default=",".join(f"{b}x{c}" for b, c in DECODE_CASES),
                        help="decode (batch)x(context) points, e.g. 1x1024,8x1024")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        log("needs a CUDA device")
        return 2
    torch.manual_seed(0)
    result = {"env": environment(), "targets": TARGETS}
    log(result["env"])
    copy_bw = copy_bandwidth()
    result["copy_TBps"] = copy_bw / 1e12
    log(f"copy bandwidth {copy_bw / 1e12:.3f} TB/s")

    args.out.mkdir(parents=True, exist_ok=True)
    stem = "kernels_" + result["env"]["device"].replace("NVIDIA ", "").replace(" ", "_").lower()
    json_path = args.out / f"{stem}.json"

    result["decode"], result["prefill"], result["errors"] = [], [], []
    decode_cases = [tuple(int(v) for v in case.split("x")) for case in args.decode_cases.split(",")]
    sections = [("decode", case) for case in decode_cases]
    sections += [("prefill", tokens) for tokens in PREFILL_TOKENS] + [("head_major", None)]
    sections = [(kind, point) for kind, point in sections if kind in args.sections.split(",")]
    for kind, point in sections:
        try:
            if kind == "decode":
                row = bench_decode(DecodeCase(*point), copy_bw, "decode" in args.tune)
                result["decode"].append(row)
            elif kind == "prefill":
                row = bench_prefill(point, "prefill" in args.tune)
                result["prefill"].append(row)
            else:
                row = result["head_major_decode"] = bench_head_major(copy_bw)
            log(row if isinstance(row, list) else {k: v for k, v in row.items() if k != "sweep"})
        except Exception as exc:  # noqa: BLE001 - keep what was measured; record what failed
            result["errors"].append(f"{kind} {point}: {type(exc).__name__}: {exc}")
            log("FAILED", result["errors"][-1])
        torch.cuda.empty_cache()
        json_path.write_text(json.dumps(result, indent=1))  # progress survives a later crash

    result["targets_met"] = targets_met(result)
    json_path.write_text(json.dumps(result, indent=1))
    try:
        plot(result, args.out / f"{stem}.png")
    except Exception as exc:  # noqa: BLE001
        log("plot failed:", exc)
    summarize(result)
    return 1 if result["errors"] else 0


def targets_met(result: dict) -> dict:
    by_case = {(r["batch"], r["context"]): r for r in result["decode"]}
    met = {}
    for key, case in [("decode_64x4096_frac_copy", (64, 4096)), ("decode_1x32768_frac_copy", (1, 32768))]:
        met[key] = case in by_case and by_case[case]["paged_frac_copy"] >= TARGETS[key]
    met["paging_cost_max"] = bool(result["decode"]) and all(
        r["paging_cost"] <= TARGETS["paging_cost_max"] for r in result["decode"])
    met["prefill_vs_sdpa_min"] = bool(result["prefill"]) and all(
        r["vs_sdpa"] >= TARGETS["prefill_vs_sdpa_min"] for r in result["prefill"])
    return met


def summarize(result: dict) -> None:
    copy_bw = result["copy_TBps"] * 1e12
    log(f"\ncopy {copy_bw / 1e12:.2f} TB/s   commit {result['env']['commit'][:10]}")
    log(f"{'decode B,ctx':>14} {'splits':>6} {'paged TB/s':>10} {'%copy':>6} {'contig':>7} "
        f"{'paging':>7} {'SDPA':>6} {'%copy':>6} {'us':>7}")
    for r in result["decode"]:
        log(f"{r['batch']:>6},{r['context']:<7} {r['num_splits']:>6} {r['paged_TBps']:>10.2f} "
            f"{100 * r['paged_frac_copy']:>5.1f}% {r['contiguous_TBps']:>7.2f} "
            f"{100 * r['paging_cost']:>6.1f}% {r['sdpa_TBps']:>6.2f} {100 * r['sdpa_frac_copy']:>5.1f}% "
            f"{r['paged_s'] * 1e6:>7.1f}")
    for r in result["decode"] + result["prefill"]:
        timed = sorted((t for t in r.get("sweep", []) if "seconds" in t), key=lambda t: t["seconds"])
        if timed:
            name = f"B{r['batch']} ctx {r['context']}" if "batch" in r else f"prefill {r['tokens']}"
            log(f"  best of sweep, {name}: " + "; ".join(
                f"{t['config']} {t['seconds'] * 1e6:.1f}us" for t in timed[:3]))
    for r in result["prefill"]:
        log(f"prefill {r['tokens']:>5} tok: Triton {r['triton_TFLOPs']:.0f} TFLOP/s, "
            f"SDPA {r['sdpa_TFLOPs']:.0f} TFLOP/s, ratio {r['vs_sdpa']:.2f}")
    for r in result.get("head_major_decode", []):
        log(f"head-major decode B{r['batch']} ctx {r['context']}: {r['TBps']:.2f} TB/s "
            f"({100 * r['frac_copy']:.1f}% copy)")
    log("targets met:", result["targets_met"])
    for error in result["errors"]:
        log("ERROR", error)


if __name__ == "__main__":
    sys.exit(main())
