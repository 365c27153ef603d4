"""Triton skinny GEMM (GEMV-shaped): y = x Wᵀ (+ b) for a few rows of x.

A decode step of a few requests multiplies a handful of activation rows by every weight of the
model once, so its linears are bound by reading the weights. On the H200 cuBLAS runs the 8B's
smaller ones (qkv, o) at ~3.1 / 2.5 TB/s at batch 1 and the down projection at 3.7
(benchmarks/results/gemv_h200.json), against 4.24 TB/s of copy bandwidth.

One program owns BLOCK_N output features for every row: it streams its [BLOCK_N, K] strip of W
(row-major, contiguous along K) in [BLOCK_N, BLOCK_K] tiles and multiplies each with the rows'
[M, BLOCK_K] tile. Rows pad to 16 for the tensor cores (tl.dot's minimum), or to the next power
of two up to 64: with one row the tensor cores still beat a multiply-and-sum on the CUDA cores on
every 8B shape (qkv 3.38 vs 2.87 TB/s, down 3.84 vs 2.82; results/gemv_h200_sweep.json).

Split-K (SPLIT_K > 1) gives a weight with few blocks of output features more programs: each split
writes its fp32 partial sums to a workspace and counts itself in on a per-tile arrival counter;
the split that arrives last adds all the partials in split order, so the result does not depend
on which one that is, then resets the counter for the next launch (CUDA-graph replays included).
The counters are one set per device, so split-K launches must not run concurrently on two streams
of one device (a worker runs its model on one).
At 1-16 rows it was no faster on the H200 (be345d9: qkv 3.45 TB/s unsplit vs 3.21 / 2.95 / 2.69
at 2 / 4 / 8 splits), and the default config does not split; at 64 rows the rows' tile, re-read
from L2 by every program, makes wide tiles pay, and wide tiles leave too few programs without it.

Which rows take this kernel is ops.linear's choice (`launch_config`): up to DEFAULT_ROWS everywhere,
up to MAX_ROWS where the device's tuned table (gemv_table.py, written by bench_gemv.py) found it
faster than cuBLAS for that weight's shape.

Measured and not kept: SwiGLU's silu(gate) * up fused into the down projection's input load
(1d0c41f: 1.9 TB/s against 3.4 for the separate kernel); with programmatic dependent launch, an
L2 prefetch of the first 512 or 1,024 K columns of each program's weight strip before it waits on
the previous kernel (57aab15: the 8B step at batch 1 4.24 ms without, 4.24 / 4.37 ms with).
"""

from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl

from . import gemv_table
from .pdl import pdl_launch, wait_for_inputs
from .triton_common import device_properties, dot, dot_mode

# The most rows the kernel's tiles take (the rows' tile pads to 16, 32 or 64).
MAX_ROWS = 64
# Steps of up to this many rows take the kernel on any device with the default config: measured
# faster than cuBLAS from 1 to 16 rows on every 8B shape on the H200 (gemv_h200.json).
DEFAULT_ROWS = 16
# Arrival counters per device: one per block of output features of a split-K launch.
_MAX_SPLIT_TILES = 1 << 14


@triton.jit
def _store_out(acc, bias_ptr, out_ptr, cols, rows, col_ok, row_ok, stride_om,
               HAS_BIAS: tl.constexpr):
    if HAS_BIAS:
        acc += tl.load(bias_ptr + cols, mask=col_ok, other=0.0).to(tl.float32)[:, None]
    out_ptrs = out_ptr + rows[None, :] * stride_om + cols[:, None]
    tl.store(out_ptrs, acc.to(out_ptr.dtype.element_ty), mask=col_ok[:, None] & row_ok[None, :])


@triton.jit
def _gemv_kernel(
    x_ptr,
    w_ptr,
    bias_ptr,
    out_ptr,
    partial_ptr,  # [SPLIT_K, N, M_PAD] fp32 (split-K only)
    arrivals_ptr,  # [tiles] int32, zero between launches (split-K only)
    M,
    N,
    K,
    k_per_split,  # a multiple of BLOCK_K
    stride_xm,
    stride_wn,
    stride_om,
    HAS_BIAS: tl.constexpr,
    M_PAD: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    SPLIT_K: tl.constexpr,
    EVEN: tl.constexpr,  # N % BLOCK_N == 0 and K % BLOCK_K == 0: loads need no mask
    DOT_MODE: tl.constexpr,
    USE_PDL: tl.constexpr,
):
    wait_for_inputs(USE_PDL)
    tile = tl.program_id(0)
    split = tl.program_id(1)
    cols = tile * BLOCK_N + tl.arange(0, BLOCK_N)
    rows = tl.arange(0, M_PAD)
    col_ok = cols < N
    row_ok = rows < M
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
        acc += dot(w, tl.trans(x), DOT_MODE)
        w_ptrs += BLOCK_K
        x_ptrs += BLOCK_K
    if SPLIT_K == 1:
        _store_out(acc, bias_ptr, out_ptr, cols, rows, col_ok, row_ok, stride_om, HAS_BIAS)
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
            _store_out(total, bias_ptr, out_ptr, cols, rows, col_ok, row_ok, stride_om, HAS_BIAS)
            tl.atomic_xchg(arrivals_ptr + tile, 0, sem="relaxed", scope="gpu")


def padded_rows(rows: int) -> int:
    """The row count the kernel's tiles take: tl.dot's minimum of 16, else the next power of 2."""
    return max(16, triton.next_power_of_2(rows))


def default_config(out_features: int, in_features: int, element_size: int = 2,
                   shared_memory: int = 227 * 1024, rows: int = 1) -> dict:
    """Launch config where the device has no tuned one, from the H200 sweeps at 1-16 rows
    (bench_gemv.py, benchmarks/results/gemv_h200.json): 64 output features per program with 4
    warps were best on every 8B shape; 256-wide K tiles where there are few programs (out <= 4096:
    o, down), 128-wide otherwise; as many pipeline stages as shared memory holds, up to 5; no
    split-K."""
    block_n = 64
    block_k = 256 if out_features <= 4096 else 128
    m_pad = padded_rows(rows)
    budget = shared_memory - 8 * 1024
    while block_k > 32 and 2 * (block_n + m_pad) * block_k * element_size > budget:
        block_k //= 2  # fp32 on a card with less shared memory: two stages must fit
    stage_bytes = (block_n + m_pad) * block_k * element_size  # the weight tile and the rows' tile
    stages = max(2, min(5, budget // stage_bytes))
    return {"block_n": block_n, "block_k": block_k, "num_warps": 4, "num_stages": stages,
            "split_k": 1}


def supports(x: torch.Tensor, weight: torch.Tensor) -> bool:
    """Whether gemv_triton takes this product: 2-D, at most MAX_ROWS rows, both contiguous
    along K."""
    return (x.dim() == 2 and 0 < x.shape[0] <= MAX_ROWS and weight.dim() == 2
            and x.shape[1] == weight.shape[1]
            and x.stride(1) == 1 and weight.stride(1) == 1 and x.dtype == weight.dtype)


def _tuned(x: torch.Tensor, weight: torch.Tensor) -> dict | None:
    """The device's tuned entry for this product's shape, dtype and padded row count, if any."""
    if not x.is_cuda:
        return None
    return gemv_table.lookup(device_properties(x.device).name, str(x.dtype).removeprefix("torch."),
                             weight.shape[0], weight.shape[1], padded_rows(x.shape[0]))


def _default_for(x: torch.Tensor, weight: torch.Tensor) -> dict:
    shared_memory = device_properties(x.device).shared_memory_per_block_optin if x.is_cuda else 227 * 1024
    return default_config(weight.shape[0], weight.shape[1], x.element_size(), shared_memory, x.shape[0])


def launch_config(x: torch.Tensor, weight: torch.Tensor) -> dict | None:
    """The config ops.linear launches this product with, or None where cuBLAS should take it:
    what the device's tuned table measured for the shape, else the default up to DEFAULT_ROWS
    rows."""
    if not supports(x, weight):
        return None
    entry = _tuned(x, weight)
    if entry is not None:
        return entry["config"] if entry["backend"] == "triton" else None
    return _default_for(x, weight) if x.shape[0] <= DEFAULT_ROWS else None


@functools.lru_cache(maxsize=None)
def _arrivals(device: torch.device) -> torch.Tensor:
    """The split-K arrival counters of `device`: allocated once and kept, since captured CUDA
    graphs hold their address."""
    return torch.zeros(_MAX_SPLIT_TILES, dtype=torch.int32, device=device)


def gemv_triton(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None = None,
    *,
    config: dict | None = None,
    block_n: int | None = None,
    block_k: int | None = None,
    num_warps: int | None = None,
    num_stages: int | None = None,
    split_k: int | None = None,
) -> torch.Tensor:
    """x [M, K] @ weight [N, K]ᵀ (+ bias [N]) -> [M, N] in x's dtype, fp32 accumulation, for
    M <= MAX_ROWS. The launch config is `config` (ops.linear's, from `launch_config`), else the
    device's tuned one for the shape if any, else `default_config`; the other keyword arguments
    override single fields (benchmarks, tests)."""
    if not supports(x, weight):
        raise ValueError(f"gemv_triton takes x [M <= {MAX_ROWS}, K] and weight [N, K] of one dtype, "
                         f"contiguous along K; got {tuple(x.shape)} {x.dtype} and "
                         f"{tuple(weight.shape)} {weight.dtype}")
    rows = x.shape[0]
    out_features, in_features = weight.shape
    if config is None:
        config = launch_config(x, weight) or _default_for(x, weight)
    block_n = block_n or config["block_n"]
    block_k = block_k or config["block_k"]
    split_k = split_k or config.get("split_k", 1)
    tiles = triton.cdiv(out_features, block_n)
    # Each split covers whole K tiles; trailing splits may be empty (they add zeros).
    k_per_split = triton.cdiv(triton.cdiv(in_features, split_k), block_k) * block_k
    m_pad = padded_rows(rows)
    out = torch.empty(rows, out_features, dtype=x.dtype, device=x.device)
    if split_k > 1:
        if tiles > _MAX_SPLIT_TILES:
            raise ValueError(f"split-K takes at most {_MAX_SPLIT_TILES} blocks of outputs")
        partial = torch.empty(split_k, out_features, m_pad, dtype=torch.float32, device=x.device)
        arrivals = _arrivals(x.device)
    else:
        partial = arrivals = out  # unused
    _gemv_kernel[(tiles, split_k)](
        x, weight, bias if bias is not None else out, out, partial, arrivals,
        rows, out_features, in_features, k_per_split,
        x.stride(0), weight.stride(0), out.stride(0),
        HAS_BIAS=bias is not None,
        M_PAD=m_pad,
        BLOCK_N=block_n,
        BLOCK_K=block_k,
        SPLIT_K=split_k,
        EVEN=out_features % block_n == 0 and in_features % block_k == 0,
        DOT_MODE=dot_mode(x),
        num_warps=num_warps or config["num_warps"],
        num_stages=num_stages or config["num_stages"],
        **pdl_launch(x),
    )
    return out
