"""The small-batch linears of a decode step: Triton skinny GEMM (raypaged/kernels/gemv.py) against
cuBLAS (F.linear), on the 8B's weight shapes, on a GPU.

    python -m benchmarks.bench_gemv [--rows 1,2,4,8,16] [--tune-rows 1,8] [--tp 2] [--out DIR]
Checks each kernel config against F.linear first, then times: every call a CUDA-graph replay (as
a decode step runs them), rotating over enough copies of the weight that they are >= 4x L2.
Achieved bandwidth = (weight + input + output bytes) / time, against a device-to-device copy in
the same run. At --tune-rows it sweeps block sizes, warps and stages per shape and records every
timing; at --rows it times the best config found (and the current default) against cuBLAS.
Writes gemv_<device>.json and a PNG under --out; `--replot JSON` redraws a saved run's PNG.
--fp8: each linear with an e4m3 weight instead (benchmarks/lib/gemv_fp8.py): at each --rows the
weight-only skinny kernel (kernels/gemv_fp8.py) up to its rows, W8A8 as the larger steps run it
(the rows' quantization kernel + torch._scaled_mm; the GEMM alone too, with row-wise and with
tensor-wise scales), the fused W8A8 kernel (kernels/gemm_w8a8.py) and bf16 cuBLAS, bandwidth by
each one's own bytes -> gemv_fp8_<device>.json; at each --tune-rows the sweeps of the FP8 kernels
the engine may launch at those rows, the fused kernel's recorded in --table where it beat the
engine's path.
"""

from __future__ import annotations

import argparse
import itertools
import json
import math
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

from benchmarks.lib.common import (
    L2_BYTES,
    SHAPES,
    add_replot_argument,
    copy_bandwidth,
    device_tag,
    environment,
    graph_time,
    log,
    replot,
)
from raypaged.kernels import gemv_table
from raypaged.kernels.gemv import gemv_triton
from raypaged.kernels.gemv_config import padded_rows

DTYPE = torch.bfloat16


def weight_shapes(shape: str, tp: int = 1) -> dict[str, tuple[int, int]]:
    """(out, in) features of one rank's share of each linear of a layer, and of the LM head:
    column-parallel ones (qkv, gate/up, LM head) split their outputs over the tp ranks,
    row-parallel ones (o, down) their inputs (KV heads replicate below one a rank)."""
    s = SHAPES[shape]
    h, i = s["hidden_size"], s["intermediate_size"]
    head_dim = h // s["num_attention_heads"]
    kv = max(1, s["num_key_value_heads"] // tp) * head_dim
    return {"qkv": (h // tp + 2 * kv, h), "o": (h, h // tp), "gate_up": (2 * i // tp, h),
            "down": (h, i // tp), "lm_head": (-(-s["vocab_size"] // tp), h)}


class Case:
    """One linear at one row count."""

    def __init__(self, out_features: int, in_features: int, rows: int) -> None:
        weight_bytes = out_features * in_features * DTYPE.itemsize
        self.variants = max(1, math.ceil(4 * L2_BYTES / weight_bytes))
        self.weights = [torch.randn(out_features, in_features, dtype=DTYPE, device="cuda") * 0.02
                        for _ in range(self.variants)]
        self.x = torch.randn(self.variants, rows, in_features, dtype=DTYPE, device="cuda")
        self.rows, self.out_features, self.in_features = rows, out_features, in_features
        self.bytes = weight_bytes + rows * (in_features + out_features) * DTYPE.itemsize

    def max_error(self, **config) -> float:
        """Largest |triton - fp32 product| over the bf16 rounding of cuBLAS's own result."""
        exact = self.x[0].float() @ self.weights[0].float().t()
        ours = (gemv_triton(self.x[0], self.weights[0], **config).float() - exact).abs().max()
        cublas = (F.linear(self.x[0], self.weights[0]).float() - exact).abs().max()
        return (ours / cublas.clamp_min(1e-6)).item()

    def time(self, fn) -> float:
        return graph_time(lambda i: fn(self.x[i], self.weights[i]), self.variants, calls=24,
                          replays=15)


def sweep(case: Case) -> list[dict]:
    # The first sweep (0c32da4: 16-64 features x 128-512 K x 4/8 warps x 3/5 stages, and a
    # one-row CUDA-core path since removed) found 64 x 128-256, 4 warps, 5 stages best
    # everywhere; a second (be345d9) found split-K no faster at 2-8 splits; fusing silu(gate) * up
    # on the down projection's input halved its speed (1d0c41f). At up to 16 rows this one sweeps
    # around the best. Past 16 rows the rows' own tile, re-read by every program, grows with them:
    # wider weight tiles reuse it, and split-K gives the fewer programs of a narrow weight work.
    if case.rows <= 16:
        configs = [{"block_n": bn, "block_k": bk, "num_warps": w, "num_stages": st}
                   for bn, bk, w, st in itertools.product((32, 64, 128), (128, 256), (4, 8), (3, 4, 5))]
    else:
        sms = torch.cuda.get_device_properties(0).multi_processor_count
        configs = [{"block_n": bn, "block_k": 128, "num_warps": w, "num_stages": st, "split_k": split}
                   for (bn, w), st, split in itertools.product(
                       ((64, 4), (128, 4), (128, 8), (256, 8)), (3, 4), (1, 2, 4, 8))
                   if split == 1 or -(-case.out_features // bn) * split <= 2 * sms]
        configs.append({"block_n": 64, "block_k": 64, "num_warps": 4, "num_stages": 3, "split_k": 1})
    results = []
    for config in configs:
        try:
            error = case.max_error(**config)
            if error > 2.0:
                raise AssertionError(f"error {error:.2f}x cuBLAS's rounding")
            seconds = case.time(lambda x, w, config=config: gemv_triton(x, w, **config))
            results.append({"config": config, "seconds": seconds, "TBps": case.bytes / seconds / 1e12})
        except Exception as exc:  # noqa: BLE001 - a config that fails to compile or fit is recorded
            results.append({"config": config, "error": f"{type(exc).__name__}: {str(exc)[:200]}"})
    return results


def table_entry(name: str, case: Case, runs: list[dict]) -> dict | None:
    """The tuned-table entry (raypaged/kernels/gemv_table.py) for a swept shape: the best config, and
    whether it beat cuBLAS timed in the same run (by more than 1%, else cuBLAS keeps it)."""
    timed = [r for r in runs if "seconds" in r]
    if not timed:
        return None
    best = min(timed, key=lambda r: r["seconds"])
    cublas = case.time(F.linear)
    config = dict(best["config"])
    config.setdefault("split_k", 1)
    return {"linear": name, "dtype": str(DTYPE).removeprefix("torch."), "out": case.out_features,
            "in": case.in_features, "rows": padded_rows(case.rows),
            "backend": "triton" if best["seconds"] < 0.99 * cublas else "cublas", "config": config,
            "triton_TBps": best["TBps"], "cublas_TBps": case.bytes / cublas / 1e12}


def plot(result: dict, path: Path) -> None:
    """Bandwidth of each linear, cuBLAS beside the skinny GEMM at each row count, and the copy."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = list(dict.fromkeys(r["linear"] for r in result["rows"]))
    row_counts = sorted({r["rows"] for r in result["rows"]})
    by_key = {(r["linear"], r["rows"]): r for r in result["rows"]}
    fig, ax = plt.subplots(figsize=(10, 4.5))
    width = 0.8 / (2 * len(row_counts))
    for j, rows in enumerate(row_counts):
        for k, (column, label, color) in enumerate([("cublas_TBps", "cuBLAS", "tab:gray"),
                                                    ("default_TBps", "skinny GEMM", "tab:blue")]):
            xs = [i + (2 * j + k) * width for i in range(len(names))]
            ys = [by_key.get((n, rows), {}).get(column, 0) for n in names]
            ax.bar(xs, ys, width, color=color, alpha=0.4 + 0.6 * (j + 1) / len(row_counts),
                   label=f"{label}, {rows} rows")
    ax.axhline(result["copy_TBps"], color="k", linestyle="--", label="copy, same run")
    ax.set_xticks([i + 0.4 - width / 2 for i in range(len(names))], names)
    ax.set_ylabel("TB/s (weight + input + output bytes / time)")
    ax.set_title(f"{result['shape']} linears, tp {result.get('tp', 1)}, "
                 f"{result['env']['device']} ({str(result['env']['commit'])[:7]})")
    ax.legend(fontsize=7, ncol=2, loc="lower right")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shape", choices=sorted(SHAPES), default="8b")
    parser.add_argument("--rows", default="1,2,4,8,16")
    parser.add_argument("--tune-rows", default="1,8")
    parser.add_argument("--tp", type=int, default=1, help="one rank's share of each weight")
    parser.add_argument("--out", type=Path, default=Path("benchmarks/results"))
    parser.add_argument("--table", type=Path, default=None,
                        help="record the --tune-rows winners (kernel config or cuBLAS) in this "
                             "tuned table, e.g. raypaged/kernels/configs/gemv_nvidia_h200.json")
    parser.add_argument("--fp8", action="store_true",
                        help="e4m3 weights: W8A16 kernel vs W8A8 (engine, fused) vs bf16")
    parser.add_argument("--w8a16-tune-rows", default=None,
                        help="--fp8: the --tune-rows at which the weight-only kernels are swept "
                             "(default: all of them up to 16); the fused W8A8 kernel's sweep keeps "
                             "--tune-rows")
    add_replot_argument(parser)
    args = parser.parse_args()
    if args.replot is not None:
        return replot(args.replot, plot)
    if not torch.cuda.is_available():
        log("needs a CUDA device")
        return 2
    torch.manual_seed(0)
    result = {"env": environment(), "shape": args.shape, "tp": args.tp,
              "copy_TBps": copy_bandwidth(torch.device("cuda")) / 1e12,
              "sweeps": {}, "rows": []}
    log(result["env"], f"copy {result['copy_TBps']:.3f} TB/s")
    args.out.mkdir(parents=True, exist_ok=True)
    stem = f"gemv_{'fp8_' if args.fp8 else ''}{device_tag()}"
    path = args.out / (stem + (f"_tp{args.tp}" if args.tp > 1 else "") + ".json")
    if args.fp8:
        from benchmarks.lib import gemv_fp8

        gemv_fp8.run(args, result, weight_shapes(args.shape, args.tp),
                     lambda: path.write_text(json.dumps(result, indent=1)))
        log(f"wrote {path}")
        return 0
    tune_rows = [int(r) for r in args.tune_rows.split(",") if r]
    for name, (n, k) in weight_shapes(args.shape, args.tp).items():
        best: dict[int, dict] = {}
        for rows in tune_rows:
            case = Case(n, k, rows)
            runs = sweep(case)
            result["sweeps"][f"{name}/{rows}"] = runs
            timed = [r for r in runs if "seconds" in r]
            if timed:
                best[rows] = min(timed, key=lambda r: r["seconds"])["config"]
                tb_per_s = case.bytes / min(r['seconds'] for r in timed) / 1e12
                log(f"{name} rows {rows}: best {best[rows]} {tb_per_s:.2f} TB/s")
            if args.table is not None and (entry := table_entry(name, case, runs)) is not None:
                # Recorded at once, so that the timing below ("default") launches what it chose.
                gemv_table.record(args.table, torch.cuda.get_device_name(), result["env"], [entry])
                log(f"{name} rows {rows}: table -> {entry['backend']} ({entry['triton_TBps']:.2f} vs "
                    f"cuBLAS {entry['cublas_TBps']:.2f} TB/s)")
            del case
        for rows in [int(r) for r in args.rows.split(",")]:
            case = Case(n, k, rows)
            cublas = case.time(F.linear)
            row = {"linear": name, "out": n, "in": k, "rows": rows, "cublas_s": cublas,
                   "cublas_TBps": case.bytes / cublas / 1e12}
            nearest = min(best, key=lambda r: abs(r - rows)) if best else None
            # "default": what ops.linear launches (the tuned table's config, else default_config)
            for label, config in [("default", {}),
                                  ("tuned", best.get(nearest))]:
                if config is None:
                    continue
                seconds = case.time(lambda x, w, config=config: gemv_triton(x, w, **config))
                row[f"{label}_config"] = config
                row[f"{label}_s"] = seconds
                row[f"{label}_TBps"] = case.bytes / seconds / 1e12
                row[f"{label}_vs_cublas"] = cublas / seconds
            result["rows"].append(row)
            log(f"{name:8s} rows {rows:2d}: cuBLAS {row['cublas_TBps']:.2f} TB/s, default "
                f"{row.get('default_TBps', 0):.2f}, tuned {row.get('tuned_TBps', 0):.2f} TB/s")
            del case
            torch.cuda.empty_cache()
        path.write_text(json.dumps(result, indent=1))  # progress survives a later crash
    path.write_text(json.dumps(result, indent=1))
    plot(result, path.with_suffix(".png"))
    log(f"wrote {path} and {path.with_suffix('.png').name}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
