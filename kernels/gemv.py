"""Triton skinny GEMM (GEMV-shaped): y = x Wᵀ (+ b) for a few rows of x.

A decode step of a few requests multiplies a handful of activation rows by every weight of the
model once, so its linears are bound by reading the weights. On the H200 cuBLAS runs the 8B's
smaller ones (qkv, o) at ~3.1 / 2.5 TB/s at batch 1 and the down projection at 3.7
(benchmarks/results/gemv_h200.json), against 4.24 TB/s of copy bandwidth.

A program owns BLOCK_N output features for every row and one slice of K: it streams its
[BLOCK_N, K / SPLIT_K] strip of W (row-major, contiguous along K) in [BLOCK_N, BLOCK_K] tiles and
multiplies each with the rows' [M, BLOCK_K] tile. Rows pad to 16 for the tensor cores (tl.dot's
minimum); with one row a plain multiply-and-sum (CUDA cores) is the alternative (USE_DOT=False).

Split-K (SPLIT_K > 1) gives a narrow weight (few blocks of output features) enough programs to
fill the card. Each split writes its fp32 partial sums to a workspace and counts itself in on a
per-tile arrival counter; the split that arrives last adds all the partials in split order, so
the result does not depend on which one that is, then resets the counter for the next launch
(CUDA-graph replays included). The counters are shared by every launch on a device: launches
must not run concurrently on two streams.

SILU_MUL: x is [M, 2K] (gate | up) and the product takes silu(gate) * up, rounded as
model/fused.py's silu_and_mul rounds it, without that kernel or its output in memory.
"""

from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl

from .triton_common import dot, dot_mode, num_sms

# The widest row count this kernel serves; past it the weight tile is reused across enough rows
# for cuBLAS's GEMMs to be the faster choice.
MAX_ROWS = 16
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
    USE_DOT: tl.constexpr,
    SILU_MUL: tl.constexpr,
    DOT_MODE: tl.constexpr,
):
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
        if SILU_MUL:
            gate = x.to(tl.float32)
            up = tl.load(x_ptrs + K, mask=x_mask, other=0.0)
            activated = (gate * tl.sigmoid(gate)).to(x.dtype).to(tl.float32)
            x = (activated * up.to(tl.float32)).to(x.dtype)
        if USE_DOT:
            acc += dot(w, tl.trans(x), DOT_MODE)
        else:  # M_PAD == 1
            acc += tl.sum(w.to(tl.float32) * x.to(tl.float32), axis=1)[:, None]
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


def default_config(rows: int, out_features: int, in_features: int, element_size: int = 2,
                   shared_memory: int = 227 * 1024, sm_count: int = 132) -> dict:
    """Launch config for [rows, in] x [out, in]ᵀ, from the H200 sweep (bench_gemv.py,
    benchmarks/results/gemv_h200.json): 64 output features per program with 4 warps were best on
    every 8B shape; 256-wide K tiles where there are few programs (out <= 4096: o, down),
    128-wide otherwise; as many pipeline stages as shared memory holds, up to 5. Split-K until
    the programs cover the multiprocessors, keeping each split at least 8 K tiles long."""
    block_n = 64
    block_k = 256 if out_features <= 4096 else 128
    stage_bytes = (block_n + 16) * block_k * element_size  # the weight tile and the rows' tile
    stages = max(2, min(5, (shared_memory - 8 * 1024) // stage_bytes))
    tiles = -(-out_features // block_n)
    split_k = 1
    while tiles * split_k < sm_count and in_features >= 2 * split_k * 8 * block_k:
        split_k *= 2
    return {"block_n": block_n, "block_k": block_k, "num_warps": 4, "num_stages": stages,
            "use_dot": True, "split_k": split_k}


@functools.lru_cache(maxsize=None)
def _device_limits(device_index: int) -> tuple[int, int]:
    props = torch.cuda.get_device_properties(device_index)
    return props.shared_memory_per_block_optin, props.multi_processor_count


@functools.lru_cache(maxsize=None)
def _arrivals(device: torch.device) -> torch.Tensor:
    """The split-K arrival counters of `device`: allocated once and kept, since captured CUDA
    graphs hold their address."""
    return torch.zeros(_MAX_SPLIT_TILES, dtype=torch.int32, device=device)


def supports(x: torch.Tensor, weight: torch.Tensor, silu_mul: bool = False) -> bool:
    """Whether gemv_triton takes this product: 2-D, few rows, both contiguous along K, x as wide
    as the weight (twice as wide with silu_mul)."""
    width = weight.shape[1] * (2 if silu_mul else 1) if weight.dim() == 2 else -1
    return (x.dim() == 2 and 0 < x.shape[0] <= MAX_ROWS and x.shape[1] == width
            and x.stride(1) == 1 and weight.stride(1) == 1 and x.dtype == weight.dtype)


def gemv_triton(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None = None,
    *,
    silu_mul: bool = False,
    block_n: int | None = None,
    block_k: int | None = None,
    num_warps: int | None = None,
    num_stages: int | None = None,
    use_dot: bool | None = None,
    split_k: int | None = None,
) -> torch.Tensor:
    """x [M, K] @ weight [N, K]ᵀ (+ bias [N]) -> [M, N] in x's dtype, fp32 accumulation, for
    M <= MAX_ROWS. silu_mul: x is [M, 2K] (gate | up) and the product takes silu(gate) * up.
    The other keyword arguments override the tuned launch config (benchmarks, tests)."""
    if not supports(x, weight, silu_mul):
        raise ValueError(f"gemv_triton takes x [M <= {MAX_ROWS}, {'2K' if silu_mul else 'K'}] and "
                         f"weight [N, K] of one dtype, contiguous along K; got {tuple(x.shape)} "
                         f"{x.dtype} and {tuple(weight.shape)} {weight.dtype}")
    rows = x.shape[0]
    out_features, in_features = weight.shape
    if x.is_cuda:
        index = x.device.index if x.device.index is not None else torch.cuda.current_device()
        shared_memory, sm_count = _device_limits(index)
    else:
        shared_memory, sm_count = 227 * 1024, num_sms(x.device)
    config = default_config(rows, out_features, in_features, x.element_size(), shared_memory,
                            sm_count)
    block_n = block_n or config["block_n"]
    block_k = block_k or config["block_k"]
    split_k = split_k or config["split_k"]
    use_dot = config["use_dot"] if use_dot is None else use_dot
    if rows > 1 and not use_dot:
        raise ValueError("the multiply-and-sum path (use_dot=False) takes one row")
    tiles = triton.cdiv(out_features, block_n)
    # Each split covers whole K tiles; trailing splits may be empty (they add zeros).
    k_per_split = triton.cdiv(triton.cdiv(in_features, split_k), block_k) * block_k
    m_pad = 16 if use_dot else 1
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
        USE_DOT=use_dot,
        SILU_MUL=silu_mul,
        DOT_MODE=dot_mode(x),
        num_warps=num_warps or config["num_warps"],
        num_stages=num_stages or config["num_stages"],
    )
    return out
