"""The W8A8 GEMM with the activations' quantization fused in: one kernel for an FP8 linear's
decode-sized steps (model/quantization/fp8.py, through ops.linear_fp8_w8a8).

    out[m, n] = (Σ_g  (q[m, g] · w[n, g]) · s[m, g]) · w_scale[n]  (+ bias[n]),  in x's dtype

where g runs over K in groups of BLOCK_K, s[m, g] = max(amax(|x[m, g]|) / 448, eps) and
q[m, g] = x[m, g] · (1 / s[m, g]) clamped to ±448 and rounded to nearest-even e4m3
(numerics.grouped_w8a8_reference is the same arithmetic in torch).

Why fused: the engine's W8A8 path otherwise runs a per-token quantization kernel (fp8_quant.py)
and then `torch._scaled_mm` with row-wise scales. At decode-sized steps the weight's bytes decide
the time, and both halves of that path add to it: the separate quantization is a launch and a
round trip of the rows per linear, and the row-wise scaled GEMM is a slower kernel than cuBLASLt's
tensor-wise one (benchmarks/README.md, FP8 GEMM paths). Here each program quantizes the x tile it
is about to multiply, in registers: the weight tile goes to the tensor cores as e4m3, as loaded
(both operands K-major, the layout Hopper's FP8 MMA takes), never widened; only the A operand is
converted. Every program of a column of output tiles re-quantizes the same x tile, so the
elementwise work grows with rows × N / BLOCK_N: a kernel for few rows, where that work hides under
the weight's loads; the device's table says up to where it wins.

The activation scales are per (row, K group), finer than per token and never coarser, so the
product is at least as close to the exact one as the per-token path's. Scaling each group's fp32
dot before adding it also bounds how many products a tensor-core accumulation covers (BLOCK_K): on
Hopper, FP8 MMA accumulates with fewer than fp32's bits unless the sum is promoted, which this is,
once a group. The rounding is `_round_to_e4m3`'s bit arithmetic, not the bare conversion, so the
interpreter's q is torch's bit for bit.

Split-K (config split_k > 1), for steps whose output tiles are too few to fill the SMs: each split
writes fp32 partial sums to a workspace and counts itself in on the tile's arrival counter (the
counters gemv.py's split-K launches use; both reset them, so launches follow each other on one
stream, never run concurrently); the split that arrives last adds the partials in split order (the
result does not depend on which split that is), scales, adds the bias and stores. A K group never
straddles two splits (each split covers whole BLOCK_K tiles), so the result is the same for every
split_k. No host synchronization: CUDA-graph capturable. Under PDL the kernel waits for its inputs
first, as every kernel of a decode step does (pdl.py).

Which products take it: `w8a8_config`, from the device's tuned table (gemv_table.py, dtype key
TABLE_DTYPE), written by `benchmarks/bench_gemv.py --fp8 --tune-rows ...` only where this kernel
beat the path the engine runs at those rows. No entry, no fused kernel: the step runs as before.
No rope / SwiGLU epilogue: the layer runs those as separate kernels after it.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from . import gemv_table
from .fp8_quant import FP8_MAX, MIN_SCALE, _round_to_e4m3
from .gemv import split_k_span, split_k_workspace
from .pdl import pdl_launch, wait_for_inputs
from .triton_common import device_properties

FP8_WEIGHT = torch.float8_e4m3fn
TABLE_DTYPE = "float8_e4m3fn_w8a8"  # the tuned table's key for this kernel's entries
# Rows the kernel may take in the engine: from 2 (one row has the weight-only one-row kernel,
# gemv_fp8.py) to MAX_ROWS (past it, the step is compute-bound and the re-quantization per tile
# of outputs grows with the rows: the separate quantization and cuBLASLt take it).
MIN_ROWS = 2
MAX_ROWS = 256
ROW_DTYPES = (torch.bfloat16, torch.float16, torch.float32)
CONFIG_FIELDS = ("block_m", "block_n", "block_k", "num_warps", "num_stages", "split_k")


def table_rows(rows: int) -> int:
    """The tuned table's row key: the next power of two, at least 16 (tl.dot's minimum tile)."""
    return max(16, triton.next_power_of_2(rows))


def default_config(rows: int) -> dict:
    """The config the benchmark times as this kernel's default (and tests use): one 16- to 64-row
    tile of rows, 128 outputs by 128 K a program, no split. A guess, not a measurement: the tuned
    table's entries are what the engine runs."""
    return {"block_m": min(64, table_rows(rows)), "block_n": 128, "block_k": 128, "num_warps": 4,
            "num_stages": 3, "split_k": 1}


def supports(x: torch.Tensor, weight: torch.Tensor) -> bool:
    """x [M, K] (bf16, fp16 or fp32; M >= 1) and an e4m3 weight [N, K], both contiguous along K."""
    return (x.dim() == 2 and x.shape[0] > 0 and weight.dim() == 2 and x.shape[1] == weight.shape[1]
            and x.stride(1) == 1 and weight.stride(1) == 1 and x.dtype in ROW_DTYPES
            and weight.dtype == FP8_WEIGHT)


def tuned_entry(x: torch.Tensor, weight: torch.Tensor) -> dict | None:
    """The device's tuned entry for this product (TABLE_DTYPE, N, K, table_rows(M)), if any;
    None off CUDA."""
    if not x.is_cuda:
        return None
    return gemv_table.lookup(device_properties(x.device).name, TABLE_DTYPE, weight.shape[0],
                             weight.shape[1], table_rows(x.shape[0]))


def w8a8_config(x: torch.Tensor, weight: torch.Tensor) -> dict | None:
    """The config to run this product with, or None (then the caller's current path): the
    device's tuned entry where it chose this kernel ("backend": "triton"), for MIN_ROWS <= M <=
    MAX_ROWS rows of bf16 or fp16 (the sweep's rows are bf16; fp32 rows would double the x tile
    its stages were fitted to)."""
    if (not supports(x, weight) or x.dtype == torch.float32
            or not MIN_ROWS <= x.shape[0] <= MAX_ROWS):
        return None
    entry = tuned_entry(x, weight)
    if entry is None or entry["backend"] != "triton":
        return None
    return dict(entry["config"])


def gemm_w8a8(x: torch.Tensor, weight: torch.Tensor, w_scale: torch.Tensor, bias: torch.Tensor | None,
              config: dict) -> torch.Tensor:
    """x [M, K] times an e4m3 weight [N, K]ᵀ with x quantized per (row, block_k group) in the
    kernel, scaled by w_scale [N] (fp32), plus bias [N] -> [M, N] in x's dtype (module
    docstring). `config`: CONFIG_FIELDS (w8a8_config's, or default_config's)."""
    if not supports(x, weight):
        raise ValueError(f"gemm_w8a8 takes x [M, K] (bf16/fp16/fp32) and an e4m3 weight [N, K], contiguous "
                         f"along K; got {tuple(x.shape)} {x.dtype} and {tuple(weight.shape)} {weight.dtype}")
    if w_scale.numel() != weight.shape[0]:
        raise ValueError(f"{w_scale.numel()} weight scales for {weight.shape[0]} output features")
    unknown = set(config) - set(CONFIG_FIELDS)
    if unknown:
        raise TypeError(f"gemm_w8a8 got unknown config fields {sorted(unknown)}")
    rows, in_features = x.shape
    out_features = weight.shape[0]
    block_m, block_n, block_k = config["block_m"], config["block_n"], config["block_k"]
    split_k = config.get("split_k", 1)
    scale = w_scale.float().contiguous().view(-1)
    out = torch.empty(rows, out_features, dtype=x.dtype, device=x.device)
    tiles = triton.cdiv(rows, block_m) * triton.cdiv(out_features, block_n)
    # Whole K groups a split: a group's scale never straddles two.
    k_per_split = split_k_span(in_features, split_k, block_k)
    partial, arrivals = split_k_workspace(out, split_k, tiles, (rows, out_features))
    _w8a8_kernel[(tiles, split_k)](
        x, weight, scale, bias if bias is not None else out, out, partial, arrivals,
        rows, out_features, in_features, k_per_split, x.stride(0), weight.stride(0), out.stride(0),
        HAS_BIAS=bias is not None, BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k, SPLIT_K=split_k,
        EVEN_N=out_features % block_n == 0, EVEN_K=in_features % block_k == 0,
        FP8_MAX=FP8_MAX, MIN_SCALE=MIN_SCALE,
        num_warps=config["num_warps"], num_stages=config["num_stages"], **pdl_launch(x),
    )
    return out


@triton.jit
def _w8a8_kernel(
    x_ptr,  # [M, K] bf16 / fp16 / fp32
    w_ptr,  # [N, K] e4m3
    w_scale_ptr,  # [N] fp32
    bias_ptr,  # [N] (HAS_BIAS only)
    out_ptr,  # [M, N] x's dtype
    partial_ptr,  # [SPLIT_K, M, N] fp32 (split-K only)
    arrivals_ptr,  # [tiles] int32, zero between launches (split-K only)
    M,
    N,
    K,
    k_per_split,  # a multiple of BLOCK_K
    stride_xm,
    stride_wn,
    stride_om,
    HAS_BIAS: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    SPLIT_K: tl.constexpr,
    EVEN_N: tl.constexpr,  # N % BLOCK_N == 0: the weight's loads need no feature mask
    EVEN_K: tl.constexpr,  # K % BLOCK_K == 0: no K mask
    FP8_MAX: tl.constexpr,
    MIN_SCALE: tl.constexpr,
    USE_PDL: tl.constexpr,
):
    wait_for_inputs(USE_PDL)
    tile = tl.program_id(0)
    split = tl.program_id(1)
    # The row tiles of one block of outputs are neighbours in launch order: they read the same
    # weight tiles at about the same time, so all but the first find them in L2.
    m_tiles = tl.cdiv(M, BLOCK_M)
    rows = (tile % m_tiles) * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = (tile // m_tiles) * BLOCK_N + tl.arange(0, BLOCK_N)
    row_ok = rows < M
    col_ok = cols < N
    ks = tl.arange(0, BLOCK_K)
    k_start = split * k_per_split
    k_end = tl.minimum(k_start + k_per_split, K)
    x_ptrs = x_ptr + rows[:, None].to(tl.int64) * stride_xm + k_start + ks[None, :]
    # [BLOCK_K, BLOCK_N] straight from the [N, K] weight: K contiguous, as the MMA's B operand.
    w_ptrs = w_ptr + cols[None, :].to(tl.int64) * stride_wn + k_start + ks[:, None]
    acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    for k0 in range(k_start, k_end, BLOCK_K):
        if EVEN_K:
            x = tl.load(x_ptrs, mask=row_ok[:, None], other=0.0)
            if EVEN_N:
                w = tl.load(w_ptrs)
            else:
                w = tl.load(w_ptrs, mask=col_ok[None, :], other=0.0)
        else:
            k_ok = (k0 + ks) < K
            x = tl.load(x_ptrs, mask=row_ok[:, None] & k_ok[None, :], other=0.0)
            w = tl.load(w_ptrs, mask=k_ok[:, None] & col_ok[None, :], other=0.0)
        x = x.to(tl.float32)
        # Masked-off rows and K columns are zeros: they leave the group's amax alone.
        scale = tl.maximum(tl.div_rn(tl.max(tl.abs(x), axis=1), FP8_MAX), MIN_SCALE)
        inverse = tl.div_rn(tl.full([BLOCK_M], 1.0, tl.float32), scale)
        q = _round_to_e4m3(tl.clamp(x * inverse[:, None], -FP8_MAX, FP8_MAX)).to(tl.float8e4nv)
        acc += tl.dot(q, w) * scale[:, None]
        x_ptrs += BLOCK_K
        w_ptrs += BLOCK_K
    if SPLIT_K == 1:
        _finish(acc, w_scale_ptr, bias_ptr, out_ptr, rows, cols, row_ok, col_ok, stride_om, HAS_BIAS)
    else:
        offsets = rows[:, None] * N + cols[None, :]
        mask = row_ok[:, None] & col_ok[None, :]
        tl.store(partial_ptr + split * M * N + offsets, acc, mask=mask)
        # Every thread's partial is stored before the counter moves; acq_rel at GPU scope makes
        # them visible to whichever program arrives last, and theirs to it.
        tl.debug_barrier()
        arrived = tl.atomic_add(arrivals_ptr + tile, 1, sem="acq_rel", scope="gpu")
        if arrived == SPLIT_K - 1:
            total = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
            for s in tl.static_range(SPLIT_K):
                total += tl.load(partial_ptr + s * M * N + offsets, mask=mask, other=0.0, cache_modifier=".cg")
            _finish(total, w_scale_ptr, bias_ptr, out_ptr, rows, cols, row_ok, col_ok, stride_om, HAS_BIAS)
            tl.atomic_xchg(arrivals_ptr + tile, 0, sem="relaxed", scope="gpu")


@triton.jit
def _finish(acc, w_scale_ptr, bias_ptr, out_ptr, rows, cols, row_ok, col_ok, stride_om,
            HAS_BIAS: tl.constexpr):
    """The fp32 sums times each output feature's scale, plus the bias, stored in out's dtype."""
    acc = acc * tl.load(w_scale_ptr + cols, mask=col_ok, other=0.0)[None, :]
    if HAS_BIAS:
        acc += tl.load(bias_ptr + cols, mask=col_ok, other=0.0).to(tl.float32)[None, :]
    out_ptrs = out_ptr + rows[:, None].to(tl.int64) * stride_om + cols[None, :]
    tl.store(out_ptrs, acc.to(out_ptr.dtype.element_ty), mask=row_ok[:, None] & col_ok[None, :])
