"""Triton skinny GEMM (GEMV-shaped): y = x Wᵀ (+ b) for a few rows of x.

A decode step of a few requests multiplies a handful of activation rows by every weight of the
model once, so its linears are bound by reading the weights, and cuBLAS reads the 8B's smaller
ones well below the copy bandwidth (benchmarks/README.md, small-batch linears).

One program owns BLOCK_N output features for every row: it streams its [BLOCK_N, K] strip of W
(row-major, contiguous along K) in [BLOCK_N, BLOCK_K] tiles and multiplies each with the rows'
[M, BLOCK_K] tile. Rows pad to 16 for the tensor cores (tl.dot's minimum), or to the next power
of two up to 64: with one row the tensor cores still beat a multiply-and-sum on the CUDA cores on
every 8B shape.

Split-K (SPLIT_K > 1) gives a weight with few blocks of output features more programs: each split
writes its fp32 partial sums to a workspace and counts itself in on a per-tile arrival counter;
the split that arrives last adds all the partials in split order, so the result does not depend
on which one that is, then resets the counter for the next launch (CUDA-graph replays included).
The counters are one set per device, so split-K launches must not run concurrently on two streams
of one device (a worker runs its model on one).
At 1-16 rows it is no faster, and the default config does not split; at 64 rows the rows' tile,
re-read from L2 by every program, makes wide tiles pay, and wide tiles leave too few programs
without it.

Which rows take this kernel, and with which config, is gemv_config.py's choice (ops.linear asks
its `launch_config`, the fused layers its `epilogue_config`).

WEIGHT_FP8 reads an e4m3 weight (one byte an element) and widens each tile to the rows' dtype
in registers, the fp32 sums scaled by each output feature's scale before the epilogue: the
weight-only FP8 product of gemv_fp8.py (ops.linear_fp8).

`gemv_rope` and `gemv_silu_mul` run the product with the decoder's next elementwise step in the
epilogue (gemv_epilogues.py): ops.linear_rope / linear_silu_mul, from EPILOGUE_MIN_ROWS rows
(`epilogue_config`). What was measured and not kept is in benchmarks/README.md (history).
"""

from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl

from .gemv_config import MAX_ROWS, default_for, launch_config, padded_rows, supports
from .gemv_epilogues import PLAIN, ROPE, SILU_MUL, finish, output_columns, rotation
from .pdl import let_dependents_launch, pdl_launch, wait_for_inputs, wait_only
from .triton_common import dot, dot_mode

_CONFIG_FIELDS = {"block_n", "block_k", "num_warps", "num_stages", "split_k"}
# Arrival counters per device: one per block of output features of a split-K launch.
_MAX_SPLIT_TILES = 1 << 14


@triton.jit
def _gemv_kernel(
    x_ptr,
    w_ptr,
    bias_ptr,
    out_ptr,
    partial_ptr,  # [SPLIT_K, N, M_PAD] fp32 (split-K only)
    arrivals_ptr,  # [tiles] int32, zero between launches (split-K only)
    cos_ptr,  # [M, HALF] fp32 (ROPE only)
    sin_ptr,  # [M, HALF] fp32 (ROPE only)
    w_scale_ptr,  # [N] fp32 (WEIGHT_FP8 only)
    M,
    N,
    K,
    k_per_split,  # a multiple of BLOCK_K
    rotated_features,  # ROPE: the q and k heads' features; the v heads' after them stay as they are
    stride_xm,
    stride_wn,
    stride_om,
    HAS_BIAS: tl.constexpr,
    M_PAD: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    SPLIT_K: tl.constexpr,
    EVEN: tl.constexpr,  # N % BLOCK_N == 0 and K % BLOCK_K == 0: loads need no mask
    EPILOGUE: tl.constexpr,  # gemv_epilogues: PLAIN, ROPE or SILU_MUL
    HALF: tl.constexpr,  # ROPE: head_dim / 2
    DOT_MODE: tl.constexpr,
    WEIGHT_FP8: tl.constexpr,  # w is e4m3, widened to x's dtype; the sums scaled by w_scale[n]
    USE_PDL: tl.constexpr,
    TRIGGER_AT_END: tl.constexpr,  # PDL: let the next kernel launch at the end, not the start
):
    if TRIGGER_AT_END:
        wait_only(USE_PDL)
    else:
        wait_for_inputs(USE_PDL)
    tile = tl.program_id(0)
    split = tl.program_id(1)
    cols = output_columns(tile, N, BLOCK_N, EPILOGUE, HALF)
    rows = tl.arange(0, M_PAD)
    col_ok = cols < N
    row_ok = rows < M
    cos, sin = rotation(cos_ptr, sin_ptr, tile, rows, row_ok, EPILOGUE, HALF, BLOCK_N)
    k_start = split * k_per_split
    k_end = tl.minimum(k_start + k_per_split, K)
    w_ptrs = (w_ptr + cols[:, None].to(tl.int64) * stride_wn + k_start
              + tl.arange(0, BLOCK_K)[None, :])
    x_ptrs = x_ptr + rows[:, None] * stride_xm + k_start + tl.arange(0, BLOCK_K)[None, :]
    acc = tl.zeros([BLOCK_N, M_PAD], tl.float32)
    for k0 in range(k_start, k_end, BLOCK_K):
        if EVEN:
            x_mask = row_ok[:, None]
            w = tl.load(w_ptrs)
        else:
            k_ok = (k0 + tl.arange(0, BLOCK_K)) < K
            x_mask = row_ok[:, None] & k_ok[None, :]
            w = tl.load(w_ptrs, mask=col_ok[:, None] & k_ok[None, :], other=0.0)
        x = tl.load(x_ptrs, mask=x_mask, other=0.0)
        if WEIGHT_FP8:  # e4m3 is exact in bf16, fp16 and fp32
            if DOT_MODE == "native":
                w = w.to(x.dtype)
            else:
                w = w.to(tl.float32)
        acc += dot(w, tl.trans(x), DOT_MODE)
        w_ptrs += BLOCK_K
        x_ptrs += BLOCK_K
    if SPLIT_K == 1:
        acc = _weight_scaled(acc, w_scale_ptr, cols, col_ok, WEIGHT_FP8)
        finish(acc, bias_ptr, out_ptr, cos, sin, tile, cols, rows, col_ok, row_ok,
               stride_om, rotated_features, HAS_BIAS, EPILOGUE, HALF, BLOCK_N, M_PAD)
    else:
        offsets = cols[:, None] * M_PAD + rows[None, :]
        tl.store(partial_ptr + split * N * M_PAD + offsets, acc, mask=col_ok[:, None])
        # Every thread's partial is stored before the counter moves; acq_rel at GPU scope makes
        # them visible to whichever program arrives last, and theirs to it.
        tl.debug_barrier()
        arrived = tl.atomic_add(arrivals_ptr + tile, 1, sem="acq_rel", scope="gpu")
        if arrived == SPLIT_K - 1:
            total = tl.zeros([BLOCK_N, M_PAD], tl.float32)
            for s in tl.static_range(SPLIT_K):
                total += tl.load(partial_ptr + s * N * M_PAD + offsets, mask=col_ok[:, None],
                                 other=0.0, cache_modifier=".cg")
            total = _weight_scaled(total, w_scale_ptr, cols, col_ok, WEIGHT_FP8)
            finish(total, bias_ptr, out_ptr, cos, sin, tile, cols, rows, col_ok,
                   row_ok, stride_om, rotated_features, HAS_BIAS, EPILOGUE, HALF, BLOCK_N, M_PAD)
            tl.atomic_xchg(arrivals_ptr + tile, 0, sem="relaxed", scope="gpu")
    if TRIGGER_AT_END:
        let_dependents_launch(USE_PDL)


@triton.jit
def _weight_scaled(acc, w_scale_ptr, cols, col_ok, WEIGHT_FP8: tl.constexpr):
    """WEIGHT_FP8: the fp32 sums times each output feature's scale (before the bias)."""
    if WEIGHT_FP8:
        w_scale = tl.load(w_scale_ptr + cols, mask=col_ok, other=0.0)
        acc = acc * w_scale[:, None]
    return acc


@functools.cache
def _arrivals(device: torch.device) -> torch.Tensor:
    """The split-K arrival counters of `device`: allocated once and kept, since captured CUDA
    graphs hold their address."""
    return torch.zeros(_MAX_SPLIT_TILES, dtype=torch.int32, device=device)


def split_k_span(in_features: int, split_k: int, block_k: int) -> int:
    """The K each split of a split-K launch covers: whole BLOCK_K tiles; trailing splits may be
    empty (they add zeros)."""
    return triton.cdiv(triton.cdiv(in_features, split_k), block_k) * block_k


def split_k_workspace(out: torch.Tensor, split_k: int, tiles: int,
                      shape: tuple[int, ...]) -> tuple[torch.Tensor, torch.Tensor]:
    """A split-K launch's fp32 partial sums [split_k, *shape] and the device's arrival counters
    (one per output tile); without split-K, `out` for both (unused by the kernel)."""
    if split_k == 1:
        return out, out
    if tiles > _MAX_SPLIT_TILES:
        raise ValueError(f"split-K takes at most {_MAX_SPLIT_TILES} output tiles, got {tiles}")
    return torch.empty(split_k, *shape, dtype=torch.float32, device=out.device), _arrivals(out.device)


def gemv_triton(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None = None,
    *,
    config: dict | None = None,
    **overrides: int,
) -> torch.Tensor:
    """x [M, K] @ weight [N, K]ᵀ (+ bias [N]) -> [M, N] in x's dtype, fp32 accumulation, for
    M <= MAX_ROWS. The launch config is `config` (ops.linear's, from `launch_config`), else the
    device's tuned one for the shape if any, else `default_config`; keyword arguments block_n,
    block_k, num_warps, num_stages, split_k override single fields (benchmarks, tests)."""
    _check(x, weight)
    if config is None:
        config = launch_config(x, weight) or default_for(x, weight)
    unknown = set(overrides) - _CONFIG_FIELDS
    if unknown:
        raise TypeError(f"gemv_triton got unknown config fields {sorted(unknown)}")
    config = {**config, **overrides}
    out = torch.empty(x.shape[0], weight.shape[0], dtype=x.dtype, device=x.device)
    _launch(x, weight, bias, out, config, triton.cdiv(weight.shape[0], config["block_n"]))
    return out


def gemv_rope(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    cos: torch.Tensor,
    sin: torch.Tensor,
    head_dim: int,
    rotated_features: int,
    config: dict,
) -> torch.Tensor:
    """The qkv product [M, N] with its first `rotated_features` features (the q and k heads, of
    head_dim each) rotated by rope, by the step's tables cos, sin [M, head_dim / 2] (fp32,
    contiguous; rope.rope_tables_triton).
    `config` from `epilogue_config(x, weight, head_dim // 2, "rope")`: its block_n pairs features
    within a head."""
    _check(x, weight)
    return launch_rope(x, weight, bias, cos, sin, head_dim, rotated_features, config)


def launch_rope(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, cos: torch.Tensor,
                sin: torch.Tensor, head_dim: int, rotated_features: int, config: dict,
                weight_scale: torch.Tensor | None = None) -> torch.Tensor:
    """gemv_rope after its operands' check (weight_scale: an e4m3 weight's, gemv_fp8.py)."""
    half = head_dim // 2
    for table in (cos, sin):
        if table.shape != (x.shape[0], half) or not table.is_contiguous() or table.dtype != torch.float32:
            raise ValueError(f"rope tables must be fp32 [{x.shape[0]}, {half}], contiguous; got "
                             f"{tuple(table.shape)} {table.dtype}")
    if weight.shape[0] % head_dim or half % (config["block_n"] // 2):
        raise ValueError(f"block_n {config['block_n']} does not pair the features of heads of "
                         f"{head_dim} over {weight.shape[0]} outputs")
    out = torch.empty(x.shape[0], weight.shape[0], dtype=x.dtype, device=x.device)
    _launch(x, weight, bias, out, config, weight.shape[0] // config["block_n"], epilogue=ROPE,
            cos=cos, sin=sin, rotated_features=rotated_features, half=half, weight_scale=weight_scale)
    return out


def gemv_silu_mul(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                  config: dict) -> torch.Tensor:
    """silu(gate) * up of the product with a [gate | up] weight [2I, K] -> [M, I]. `config`
    from `epilogue_config(x, weight, I, "silu")`."""
    _check(x, weight)
    return launch_silu_mul(x, weight, bias, config)


def launch_silu_mul(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, config: dict,
                    weight_scale: torch.Tensor | None = None) -> torch.Tensor:
    """gemv_silu_mul after its operands' check (weight_scale: an e4m3 weight's, gemv_fp8.py)."""
    intermediate = weight.shape[0] // 2
    pairs = config["block_n"] // 2
    if weight.shape[0] % 2 or intermediate % pairs:
        raise ValueError(f"block_n {config['block_n']} does not pair gate and up features over "
                         f"{weight.shape[0]} outputs")
    out = torch.empty(x.shape[0], intermediate, dtype=x.dtype, device=x.device)
    _launch(x, weight, bias, out, config, intermediate // pairs, epilogue=SILU_MUL, weight_scale=weight_scale)
    return out


def _check(x: torch.Tensor, weight: torch.Tensor) -> None:
    if not supports(x, weight):
        raise ValueError(f"gemv_triton takes x [M <= {MAX_ROWS}, K] and weight [N, K] of one dtype, "
                         f"contiguous along K; got {tuple(x.shape)} {x.dtype} and "
                         f"{tuple(weight.shape)} {weight.dtype}")


def _dependents_at_end(epilogue: int) -> bool:
    """Under PDL, whether the GEMM lets the next kernel launch at its end rather than its start.

    At the start, as every other kernel does, the next kernel's launch overlaps this one. But
    when the next kernel is a GEMM too, its programs then take SMs as this one's last wave frees
    them (our reading: they crowd onto the first ones freed): a down projection launched that way
    behind the gate/up GEMM with the SwiGLU epilogue added more to the step than one launched at
    that GEMM's end, while every GEMM triggering at its end cost more still (benchmarks/README.md,
    history). So only the SwiGLU-epilogue GEMM, whose output goes straight into the down
    projection, triggers at its end."""
    return epilogue == SILU_MUL


def _launch(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, out: torch.Tensor,
            config: dict, tiles: int, epilogue: int = PLAIN, cos: torch.Tensor | None = None,
            sin: torch.Tensor | None = None, rotated_features: int = 0, half: int = 1,
            weight_scale: torch.Tensor | None = None) -> None:
    """One launch of the kernel; weight_scale [N] fp32: weight is e4m3 (WEIGHT_FP8)."""
    rows = x.shape[0]
    out_features, in_features = weight.shape
    block_n, block_k = config["block_n"], config["block_k"]
    split_k = config.get("split_k", 1)
    k_per_split = split_k_span(in_features, split_k, block_k)
    m_pad = padded_rows(rows)
    partial, arrivals = split_k_workspace(out, split_k, tiles, (out_features, m_pad))
    mode = dot_mode(x)
    _gemv_kernel[(tiles, split_k)](
        x, weight, bias if bias is not None else out, out, partial, arrivals,
        cos if cos is not None else out, sin if sin is not None else out,
        weight_scale if weight_scale is not None else out,
        rows, out_features, in_features, k_per_split, rotated_features,
        x.stride(0), weight.stride(0), out.stride(0),
        HAS_BIAS=bias is not None,
        M_PAD=m_pad,
        BLOCK_N=block_n,
        BLOCK_K=block_k,
        SPLIT_K=split_k,
        EVEN=out_features % block_n == 0 and in_features % block_k == 0,
        EPILOGUE=epilogue,
        HALF=half,
        DOT_MODE=mode,
        WEIGHT_FP8=weight_scale is not None,
        TRIGGER_AT_END=_dependents_at_end(epilogue),
        num_warps=config["num_warps"],
        num_stages=config["num_stages"],
        **pdl_launch(x),
    )
