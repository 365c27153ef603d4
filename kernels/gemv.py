"""Triton skinny GEMM (GEMV-shaped): y = x Wᵀ (+ b) for a few rows of x.

A decode step of a few requests multiplies a handful of activation rows by every weight of the
model once, so its linears are bound by reading the weights. On the H200 cuBLAS runs the 8B's
smaller ones (qkv, o) at ~3.1 / 2.5 TB/s at batch 1 and the down projection at 3.7
(benchmarks/results/gemv_h200.json), against 4.24 TB/s of copy bandwidth.

One program owns BLOCK_N output features for every row: it streams its [BLOCK_N, K] strip of W
(row-major, contiguous along K) in [BLOCK_N, BLOCK_K] tiles and multiplies each with the rows'
[M, BLOCK_K] tile. Rows pad to 16 for the tensor cores (tl.dot's minimum): with one row that
still beat a multiply-and-sum on the CUDA cores on every 8B shape (qkv 3.38 vs 2.87 TB/s, down
3.84 vs 2.82; results/gemv_h200_sweep.json). Each output is summed by one program in a fixed
order. Split-K (more programs for the narrow o / qkv / down weights, partials
added by the last split to arrive) was built and measured on the H200 at be345d9: no faster at
any split count (qkv 3.45 TB/s unsplit vs 3.21 / 2.95 / 2.69 at 2 / 4 / 8 splits, o and down
within 1%), so the occupancy of those weights is not what holds them back; it was taken out.

Fusing SwiGLU's silu(gate) * up into the down projection's input load was measured too (1d0c41f):
1.9 TB/s against 3.4 for the separate kernel and cuBLAS, so it is not done.
"""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

from .pdl import pdl_launch, prefetch_to_l2, wait_for_inputs
from .triton_common import device_properties, dot, dot_mode

# The widest row count this kernel serves: measured faster than cuBLAS from 1 to 16 rows on the
# H200; wider steps (where the weight tile is reused across more rows) stay with cuBLAS.
MAX_ROWS = int(os.environ.get("RAYPAGED_GEMV_MAX_ROWS", 16))  # EXPERIMENT: 32 / 64 under test
# EXPERIMENT: with PDL, how many K columns of its weight strip a program asks into L2 before it
# waits for the previous kernel (the weights never depend on it).
PREFETCH_K = int(os.environ.get("RAYPAGED_GEMV_PREFETCH_K", 0))


@triton.jit
def _gemv_kernel(
    x_ptr,
    w_ptr,
    bias_ptr,
    out_ptr,
    M,
    N,
    K,
    stride_xm,
    stride_wn,
    stride_om,
    HAS_BIAS: tl.constexpr,
    M_PAD: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    EVEN: tl.constexpr,  # N % BLOCK_N == 0 and K % BLOCK_K == 0: loads need no mask
    DOT_MODE: tl.constexpr,
    PREFETCH_K: tl.constexpr,
    LINE: tl.constexpr,  # elements in a 128-byte line
    USE_PDL: tl.constexpr,
):
    cols = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    if USE_PDL and PREFETCH_K > 0:
        # One address per 128-byte line of the first PREFETCH_K columns of this program's rows.
        lines = tl.arange(0, PREFETCH_K // LINE) * LINE
        prefetch_to_l2(w_ptr + tl.minimum(cols, N - 1)[:, None].to(tl.int64) * stride_wn
                       + tl.minimum(lines, K - 1)[None, :])
    wait_for_inputs(USE_PDL)
    rows = tl.arange(0, M_PAD)
    col_ok = cols < N
    row_ok = rows < M
    w_ptrs = w_ptr + cols[:, None].to(tl.int64) * stride_wn + tl.arange(0, BLOCK_K)[None, :]
    x_ptrs = x_ptr + rows[:, None] * stride_xm + tl.arange(0, BLOCK_K)[None, :]
    acc = tl.zeros([BLOCK_N, M_PAD], tl.float32)
    for k0 in range(0, K, BLOCK_K):
        if EVEN:
            x_mask = row_ok[:, None]
            w = tl.load(w_ptrs)
        else:
            k_ok = (k0 + tl.arange(0, BLOCK_K)) < K
            x_mask = row_ok[:, None] & k_ok[None, :]
            w = tl.load(w_ptrs, mask=col_ok[:, None] & k_ok[None, :], other=0.0)
        x = tl.load(x_ptrs, mask=x_mask, other=0.0)
        acc += dot(w, tl.trans(x), DOT_MODE)
        w_ptrs += BLOCK_K
        x_ptrs += BLOCK_K
    if HAS_BIAS:
        acc += tl.load(bias_ptr + cols, mask=col_ok, other=0.0).to(tl.float32)[:, None]
    out_ptrs = out_ptr + rows[None, :] * stride_om + cols[:, None]
    tl.store(out_ptrs, acc.to(out_ptr.dtype.element_ty), mask=col_ok[:, None] & row_ok[None, :])


def padded_rows(rows: int) -> int:
    """The row count the kernel's tiles take: tl.dot's minimum of 16, else the next power of 2."""
    return max(16, triton.next_power_of_2(rows))


def default_config(out_features: int, in_features: int, element_size: int = 2,
                   shared_memory: int = 227 * 1024, rows: int = 1) -> dict:
    """Launch config for x [rows <= MAX_ROWS, in] x [out, in]ᵀ (the same at every row count), from the H200 sweeps (bench_gemv.py,
    benchmarks/results/gemv_h200.json): 64 output features per program with 4 warps were best on
    every 8B shape; 256-wide K tiles where there are few programs (out <= 4096: o, down),
    128-wide otherwise; as many pipeline stages as shared memory holds, up to 5."""
    block_n = 64
    block_k = 256 if out_features <= 4096 else 128
    budget = shared_memory - 8 * 1024
    m_pad = padded_rows(rows)
    while block_k > 32 and 2 * (block_n + m_pad) * block_k * element_size > budget:
        block_k //= 2  # fp32 on a card with less shared memory: two stages must fit
    stage_bytes = (block_n + m_pad) * block_k * element_size  # the weight tile and the rows' tile
    stages = max(2, min(5, budget // stage_bytes))
    return {"block_n": block_n, "block_k": block_k, "num_warps": 4, "num_stages": stages}


def supports(x: torch.Tensor, weight: torch.Tensor) -> bool:
    """Whether gemv_triton takes this product: 2-D, few rows, both contiguous along K."""
    return (x.dim() == 2 and 0 < x.shape[0] <= MAX_ROWS and weight.dim() == 2
            and x.shape[1] == weight.shape[1]
            and x.stride(1) == 1 and weight.stride(1) == 1 and x.dtype == weight.dtype)


def gemv_triton(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None = None,
    *,
    block_n: int | None = None,
    block_k: int | None = None,
    num_warps: int | None = None,
    num_stages: int | None = None,
) -> torch.Tensor:
    """x [M, K] @ weight [N, K]ᵀ (+ bias [N]) -> [M, N] in x's dtype, fp32 accumulation, for
    M <= MAX_ROWS. The keyword arguments override the tuned launch config (benchmarks, tests)."""
    if not supports(x, weight):
        raise ValueError(f"gemv_triton takes x [M <= {MAX_ROWS}, K] and weight [N, K] of one dtype, "
                         f"contiguous along K; got {tuple(x.shape)} {x.dtype} and "
                         f"{tuple(weight.shape)} {weight.dtype}")
    rows = x.shape[0]
    out_features, in_features = weight.shape
    shared_memory = device_properties(x.device).shared_memory_per_block_optin if x.is_cuda else 227 * 1024
    config = default_config(out_features, in_features, x.element_size(), shared_memory, rows)
    block_n = block_n or config["block_n"]
    block_k = block_k or config["block_k"]
    out = torch.empty(rows, out_features, dtype=x.dtype, device=x.device)
    _gemv_kernel[(triton.cdiv(out_features, block_n),)](
        x, weight, bias if bias is not None else out, out,
        rows, out_features, in_features,
        x.stride(0), weight.stride(0), out.stride(0),
        HAS_BIAS=bias is not None,
        M_PAD=padded_rows(rows),
        BLOCK_N=block_n,
        BLOCK_K=block_k,
        EVEN=out_features % block_n == 0 and in_features % block_k == 0,
        DOT_MODE=dot_mode(x),
        PREFETCH_K=PREFETCH_K,
        LINE=128 // weight.element_size(),
        num_warps=num_warps or config["num_warps"],
        num_stages=num_stages or config["num_stages"],
        **pdl_launch(x),
    )
    return out
