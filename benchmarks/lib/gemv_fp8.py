"""bench_gemv --fp8: each linear with an e4m3 weight, on a GPU.

At each --rows: the weight-only skinny kernel (kernels/gemv_fp8.py, what the engine launches for
the shape) up to its MAX_ROWS; W8A8 as the engine's larger steps run it (the rows' quantization
kernel + torch._scaled_mm with row-wise scales), and that GEMM alone with row-wise and with
tensor-wise scales; the fused W8A8 kernel (kernels/gemm_w8a8.py: the table's config for the shape
where it has one, else its default); bf16 cuBLAS on the bf16 weight. Bandwidth by each one's own
bytes; the fused kernel's and the engine's W8A8 errors against the exact product of the rows and
the e4m3 weight.

At each --tune-rows: the weight-only kernels' configs where the engine launches them (one row:
the one-row kernel's beside the tensor-core kernel's; up to 16 rows: the tensor-core kernel's;
--w8a16-tune-rows narrows these), and from 2 to 256 rows the fused kernel's (`w8a8_configs`),
each checked against its reference, then timed. The fused kernel's best is recorded in the tuned
table as chosen ("triton") only where it beat, in the same run, the path the engine runs at those
rows without it (`engine_baseline`), else as "engine": a later run that loses replaces an earlier
winner. The LM head is not an FP8 layer (ParallelLMHead): no fused sweep for it.
"""

from __future__ import annotations

import argparse
import itertools
from collections.abc import Callable
from pathlib import Path

import torch
import torch.nn.functional as F

from benchmarks.lib.common import graph_time, log
from raypaged.kernels import gemm_w8a8, gemv_table
from raypaged.kernels.gemv_config import DEFAULT_ROWS, MAX_ROWS

# Rows of bf16 (the engine's x tiles), e4m3 weight tiles: the bytes one pipeline stage holds.
_X_BYTES = 2
# Shared memory Triton keeps for itself beside the stages (barriers, the epilogue's scratch).
_SMEM_RESERVE = 8 * 1024
# A sweep's config whose error against its reference passes this is a wrong kernel, not rounding.
_MAX_REFERENCE_ERROR = 1e-2
# The fused kernel must beat the engine's path by more than timing noise to be chosen.
_WIN_MARGIN = 0.99
# Row tiles worth trying at each table row count: one tile of the rows (the MMA's own minimum of
# 16, or 64, a Hopper warp group's), and halves of it where the rows are many.
_BLOCK_M = {16: (16, 64), 32: (16, 32, 64), 64: (16, 32, 64), 128: (32, 64, 128), 256: (64, 128)}


def w8a8_configs(out_features: int, in_features: int, rows: int, sms: int,
                 shared_memory: int = 227 * 1024) -> list[dict]:
    """The fused kernel's sweep at `rows`: block_m (`_BLOCK_M`) x block_n 64 / 128 x block_k
    128 / 256 x 4 / 8 warps x split_k 1 / 2 / 4, with 4 pipeline stages or, where their x and
    weight tiles do not fit in shared memory, 3 (a step this small is bound by the weight's
    bytes in flight: more stages, not fewer, where they fit; one stage count a tile also halves
    the compiles, which bound the sweep's time). Pruned to what can be worth timing: 8 warps only
    for tiles of 64 x 128 outputs or more, 4 only up to that; split-K only where the output
    tiles are fewer than the SMs, each split at least two K tiles, and tiles x splits at most
    twice the SMs."""
    configs = []
    for bm, bn, bk, warps, split in itertools.product(
            _BLOCK_M[gemm_w8a8.table_rows(rows)], (64, 128), (128, 256), (4, 8), (1, 2, 4)):
        outputs = bm * bn
        if (warps == 8 and outputs < 64 * 128) or (warps == 4 and outputs > 64 * 128):
            continue
        fitting = [st for st in (4, 3) if st * (bm * bk * _X_BYTES + bk * bn) <= shared_memory - _SMEM_RESERVE]
        if not fitting:
            continue
        stages = fitting[0]
        tiles = -(-rows // bm) * -(-out_features // bn)
        if split > 1 and (tiles >= sms or in_features // split < 2 * bk or tiles * split > 2 * sms):
            continue
        configs.append({"block_m": bm, "block_n": bn, "block_k": bk, "num_warps": warps,
                        "num_stages": stages, "split_k": split})
    return configs


def engine_baseline(timings: dict[str, float]) -> tuple[str, float]:
    """The path the engine runs at these rows without the fused kernel, and its seconds, from
    the timings taken: the weight-only kernel where it takes the rows ("w8a16", up to
    DEFAULT_ROWS), else W8A8 ("w8a8_scaled_mm"); where both were timed, the faster, so that
    choosing the fused kernel never makes a step slower than either."""
    label = min(timings, key=lambda name: timings[name])
    return label, timings[label]


def w8a8_table_entry(name: str, n: int, k: int, rows: int, best: dict, baseline: tuple[str, float]) -> dict:
    """The tuned-table entry of a fused-kernel sweep: its best config, and whether it beat the
    engine's path (by more than 1%: "triton"; else "engine", the path stays)."""
    path, engine_s = baseline
    wins = best["seconds"] < _WIN_MARGIN * engine_s
    return {"linear": name, "dtype": gemm_w8a8.TABLE_DTYPE, "out": n, "in": k,
            "rows": gemm_w8a8.table_rows(rows), "backend": "triton" if wins else "engine",
            "config": best["config"], "fused_us": best["seconds"] * 1e6, "engine_path": path,
            "engine_us": engine_s * 1e6, "rel_error": best["rel_error"]}


def rel_error(out: torch.Tensor, expected: torch.Tensor) -> float:
    """max |out - expected| over max |expected|."""
    return ((out.float() - expected).abs().max() / expected.abs().max()).item()


def w8a8_engine(x: torch.Tensor, wq: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """W8A8 as the larger FP8 steps run it: the rows' quantization kernel, then cuBLASLt FP8."""
    from raypaged.kernels.fp8_quant import quantize_fp8_triton

    xq, x_scale = quantize_fp8_triton(x)
    return torch._scaled_mm(xq, wq.t(), scale_a=x_scale, scale_b=scale.view(1, -1), out_dtype=torch.bfloat16)


def w8a8_gemm_alone(x: torch.Tensor, wq: torch.Tensor, scale: torch.Tensor,
                    tensorwise: bool) -> Callable[[], torch.Tensor]:
    """The FP8 GEMM without the rows' quantization (done once, outside the timing): row-wise
    scales (what the engine launches) or one scale per operand (cuBLASLt's tensor-wise path), to
    tell the quantization kernel's cost from the GEMM kernel's."""
    from raypaged.kernels.fp8_quant import quantize_fp8_triton

    xq, x_scale = quantize_fp8_triton(x)
    if tensorwise:
        x_scale, scale = x_scale.max().reshape(()), scale.max().reshape(())
    else:
        scale = scale.view(1, -1)
    return lambda: torch._scaled_mm(xq, wq.t(), scale_a=x_scale, scale_b=scale, out_dtype=torch.bfloat16)


class Fp8Case:
    """One linear at one row count, its weights quantized (per output channel, as at load)."""

    def __init__(self, n: int, k: int, rows: int) -> None:
        from benchmarks.bench_gemv import DTYPE, Case
        from raypaged.model.quantization.numerics import quantize_weight, weight_only_matmul_reference

        self.case = Case(n, k, rows)
        self.quantized = [quantize_weight(w) for w in self.case.weights]
        self.rows, self.n, self.k = rows, n, k
        self.fp8_bytes = n * k + rows * (k + n) * DTYPE.itemsize
        self.exact = weight_only_matmul_reference(self.case.x[0], *self.quantized[0])

    def time(self, fn: Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]) -> float:
        """Seconds per fn(x, e4m3 weight, scales), rotating over the weight copies."""
        return graph_time(lambda i: fn(self.case.x[i], *self.quantized[i]), self.case.variants,
                          calls=24, replays=15)

    def fused(self, config: dict) -> Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]:
        return lambda x, w, s: gemm_w8a8.gemm_w8a8(x, w, s, None, config)


def w8a16_sweep(name: str, n: int, k: int, rows: int, table: Path | None, env: dict) -> list[dict]:
    """The weight-only kernels' launch configs on one shape, each checked against the reference,
    then timed; the fastest recorded in `table` (key "float8_e4m3fn"). At more than one row the
    tensor-core kernel's configs; at one row the one-row kernel's, beside the tensor-core kernel's
    config for the shape (its tuned entry, else the default)."""
    from raypaged.kernels.gemv_fp8 import ROW_KERNEL, TABLE_DTYPE, gemv_w8a16, table_rows, w8a16_config

    fp8 = Fp8Case(n, k, rows)
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    if rows == 1:
        tensor_core = w8a16_config(fp8.case.x[0].expand(16, -1).contiguous(), fp8.quantized[0][0])
        configs = [tensor_core] + [
            {"kernel": ROW_KERNEL, "block_n": bn, "block_k": bk, "num_warps": w, "num_stages": st}
            for bn, bk, w, st in itertools.product((4, 8, 16, 32), (256, 512, 1024), (4, 8), (3, 4))
            if bn * bk <= 8192]
    else:
        configs = [{"block_n": bn, "block_k": bk, "num_warps": w, "num_stages": st, "split_k": split}
                   for bn, bk, w, st, split in itertools.product((32, 64, 128), (256, 512), (4, 8),
                                                                 (3, 5), (1, 2, 4))
                   if split == 1 or -(-n // bn) * split <= 4 * sms]
    runs = _timed(fp8, configs, lambda c: lambda x, w, s: gemv_w8a16(x, w, s, None, c), lambda c: fp8.exact)
    timed = [r for r in runs if "seconds" in r]
    if timed:
        best = min(timed, key=lambda r: r["seconds"])
        log(f"{name} rows {rows}: best W8A16 {best['config']} {best['TBps']:.2f} TB/s")
        if table is not None:
            gemv_table.record(table, torch.cuda.get_device_name(), env, [{
                "linear": name, "dtype": TABLE_DTYPE, "out": n, "in": k, "rows": table_rows(rows),
                "backend": "triton", "config": best["config"], "triton_TBps": best["TBps"],
                "cublas_TBps": fp8.case.bytes / fp8.case.time(F.linear) / 1e12}])
    return runs


def w8a8_sweep(name: str, n: int, k: int, rows: int, table: Path | None, env: dict) -> list[dict]:
    """The fused kernel's configs (`w8a8_configs`) on one shape, each checked against the grouped
    reference, then timed; its best against the engine's path at these rows, recorded in `table`
    (`w8a8_table_entry`)."""
    from raypaged.kernels.gemv_fp8 import gemv_w8a16, w8a16_config
    from raypaged.model.quantization.numerics import grouped_w8a8_reference

    fp8 = Fp8Case(n, k, rows)
    props = torch.cuda.get_device_properties(0)
    configs = w8a8_configs(n, k, rows, props.multi_processor_count, props.shared_memory_per_block_optin)
    references: dict[int, torch.Tensor] = {}

    def reference(config: dict) -> torch.Tensor:
        group = config["block_k"]
        if group not in references:
            references[group] = grouped_w8a8_reference(fp8.case.x[0], *fp8.quantized[0], group)
        return references[group]

    runs = _timed(fp8, configs, fp8.fused, reference)
    timed = [r for r in runs if "seconds" in r]
    log(f"{name} rows {rows}: {len(timed)} of {len(configs)} fused W8A8 configs ran")
    if not timed:
        return runs
    best = min(timed, key=lambda r: r["seconds"])
    best["rel_error"] = rel_error(gemm_w8a8.gemm_w8a8(fp8.case.x[0], *fp8.quantized[0], None, best["config"]),
                                  fp8.exact)
    baselines = {"w8a8_scaled_mm": fp8.time(w8a8_engine)}
    w8a16 = w8a16_config(fp8.case.x[0], fp8.quantized[0][0]) if rows <= DEFAULT_ROWS else None
    if w8a16 is not None:
        baselines["w8a16"] = fp8.time(lambda x, w, s: gemv_w8a16(x, w, s, None, w8a16))
    entry = w8a8_table_entry(name, n, k, rows, best, engine_baseline(baselines))
    log(f"{name} rows {rows}: fused W8A8 {best['config']} {entry['fused_us']:.1f} us vs the engine's "
        f"{entry['engine_path']} {entry['engine_us']:.1f} us -> {entry['backend']}")
    if table is not None:
        gemv_table.record(table, torch.cuda.get_device_name(), env, [entry])
    return runs + [{"table_entry": entry, "baselines_us": {p: s * 1e6 for p, s in baselines.items()}}]


def _timed(fp8: Fp8Case, configs: list[dict], kernel: Callable[[dict], Callable],
           expected: Callable[[dict], torch.Tensor]) -> list[dict]:
    """Each config checked against its expected product (relative error), then timed; a config
    that fails to compile, fit or compute is recorded with its error."""
    runs = []
    for config in configs:
        try:
            error = rel_error(kernel(config)(fp8.case.x[0], *fp8.quantized[0]), expected(config))
            if error > _MAX_REFERENCE_ERROR:
                raise AssertionError(f"relative error {error:.1e} against the reference")
            seconds = fp8.time(kernel(config))
            runs.append({"config": config, "seconds": seconds, "TBps": fp8.fp8_bytes / seconds / 1e12})
        except Exception as exc:  # noqa: BLE001 - a config that fails to compile or fit is recorded
            runs.append({"config": config, "error": f"{type(exc).__name__}: {str(exc)[:200]}"})
    return runs


def fp8_row(name: str, n: int, k: int, rows: int) -> dict:
    """One row count of one linear: every path's time, TB/s of its own bytes, and errors."""
    from raypaged.kernels.gemv_config import default_config
    from raypaged.kernels.gemv_fp8 import gemv_w8a16, w8a16_config

    fp8 = Fp8Case(n, k, rows)
    x, (wq, scale) = fp8.case.x[0], fp8.quantized[0]
    row: dict = {"linear": name, "out": n, "in": k, "rows": rows}
    timed = {"cublas_bf16": (fp8.case.time(F.linear), fp8.case.bytes)}
    if rows <= MAX_ROWS:  # the skinny kernel's range
        config = w8a16_config(x, wq) or default_config(n, k, 1, rows=rows)
        row |= {"w8a16_config": config, "w8a16_rel_error": rel_error(gemv_w8a16(x, wq, scale, None, config), fp8.exact)}
        timed["w8a16"] = (fp8.time(lambda x, w, s: gemv_w8a16(x, w, s, None, config)), fp8.fp8_bytes)
    row["w8a8_rel_error"] = rel_error(w8a8_engine(x, wq, scale), fp8.exact)
    timed["w8a8_scaled_mm"] = (fp8.time(w8a8_engine), fp8.fp8_bytes)
    for label, tensorwise in (("w8a8_gemm_rowwise", False), ("w8a8_gemm_tensorwise", True)):
        gemms = [w8a8_gemm_alone(fp8.case.x[i], *fp8.quantized[i], tensorwise) for i in range(fp8.case.variants)]
        timed[label] = (graph_time(lambda i, gemms=gemms: gemms[i](), fp8.case.variants, calls=24, replays=15),
                        fp8.fp8_bytes)
    entry = gemm_w8a8.tuned_entry(x, wq)
    fused = dict(entry["config"]) if entry is not None else gemm_w8a8.default_config(rows)
    row |= {"w8a8_fused_config": fused, "w8a8_fused_config_from": "table" if entry is not None else "default",
            "w8a8_fused_backend": entry["backend"] if entry is not None else None}
    try:  # a new kernel: a config that fails here must not cost the other columns
        row["w8a8_fused_rel_error"] = rel_error(gemm_w8a8.gemm_w8a8(x, wq, scale, None, fused), fp8.exact)
        timed["w8a8_fused"] = (fp8.time(fp8.fused(fused)), fp8.fp8_bytes)
    except Exception as exc:  # noqa: BLE001 - recorded in the row
        row["w8a8_fused_error"] = f"{type(exc).__name__}: {str(exc)[:200]}"
    for label, (seconds, size) in timed.items():
        row[f"{label}_us"], row[f"{label}_TBps"] = seconds * 1e6, size / seconds / 1e12
    return row


def run(args: argparse.Namespace, result: dict, shapes: dict[str, tuple[int, int]],
        save: Callable[[], None]) -> None:
    """--fp8: the sweeps at --tune-rows, then every path at --rows, into `result`; `save()`
    after each shape's sweep and row, so that a run cut by its time limit keeps what it did."""
    w8a16_rows = args.tune_rows if args.w8a16_tune_rows is None else args.w8a16_tune_rows
    for rows in _row_list(args.tune_rows):
        for name, (n, k) in shapes.items():
            if rows in _row_list(w8a16_rows) and rows <= DEFAULT_ROWS:
                result["sweeps"][f"{name}/{rows}"] = w8a16_sweep(name, n, k, rows, args.table, result["env"])
                torch.cuda.empty_cache()
                save()
            if gemm_w8a8.MIN_ROWS <= rows <= gemm_w8a8.MAX_ROWS and name != "lm_head":
                result["sweeps"][f"{name}/{rows}/w8a8_fused"] = w8a8_sweep(name, n, k, rows, args.table,
                                                                           result["env"])
                torch.cuda.empty_cache()
                save()
    for name, (n, k) in shapes.items():
        for rows in _row_list(args.rows):
            row = fp8_row(name, n, k, rows)
            result["rows"].append(row)
            skinny = (f"W8A16 {row['w8a16_us']:.1f} us (error {row['w8a16_rel_error']:.1e}), "
                      if "w8a16_us" in row else "")
            log(f"{name:8s} rows {rows:3d}: {skinny}W8A8 {row['w8a8_scaled_mm_us']:.1f} us (GEMM alone: "
                f"row-wise {row['w8a8_gemm_rowwise_us']:.1f}, tensor-wise {row['w8a8_gemm_tensorwise_us']:.1f}; "
                f"error {row['w8a8_rel_error']:.1e}), fused W8A8 {_fused_text(row)}, "
                f"bf16 cuBLAS {row['cublas_bf16_us']:.1f} us")
            torch.cuda.empty_cache()
            save()


def _fused_text(row: dict) -> str:
    if "w8a8_fused_us" not in row:
        return f"failed ({row['w8a8_fused_error']})"
    return (f"{row['w8a8_fused_us']:.1f} us ({row['w8a8_fused_config_from']}, "
            f"error {row['w8a8_fused_rel_error']:.1e})")


def _row_list(text: str) -> list[int]:
    return [int(r) for r in text.split(",") if r]
