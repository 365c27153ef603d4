"""The skinny GEMM over an FP8 (e4m3) weight: the weight-only product of a decode step's rows.

A decode step's linears are bound by reading their weights; an e4m3 weight halves those bytes.
The rows stay in the model's dtype: each [BLOCK_N, BLOCK_K] weight tile is widened in registers
(e4m3 is exact in bf16, fp16 and fp32) and multiplied as gemv_triton multiplies bf16 tiles, the
fp32 sums scaled by each output feature's scale (model/quantization's per-channel or per-tensor
scales). Quantizing the rows as well (W8A8) would cost a kernel launch per linear for nothing the
memory-bound product needs; the larger steps that are compute-bound take the W8A8 GEMM
(model/quantization/fp8.py, torch._scaled_mm).

One row (a decode step at batch 1) may take `_one_row_kernel` instead (config "kernel": "row"):
no tensor cores, each program's [BLOCK_N, BLOCK_K] weight tile widened to fp32 and multiplied
by the row on the CUDA cores. Widening an e4m3 tile into tl.dot's operand layout costs the
tensor-core kernel a pass through shared memory per tile, which caps it well below the copy
bandwidth; at one row the multiply-adds are few, and the device's tuned table (swept by
benchmarks/bench_gemv.py --fp8) says per shape which kernel is faster.

`gemv_w8a16_rope` and `gemv_w8a16_silu_mul` are the same product with the decoder's next step in
the epilogue, as gemv_rope / gemv_silu_mul for bf16 weights (gemv_epilogues.py): the fp32 sums
are scaled per feature first, then rounded to the rows' dtype and rotated or activated, so each
equals gemv_w8a16 followed by the separate kernel.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from . import gemv_table
from .gemv import _launch, launch_rope, launch_silu_mul
from .gemv_config import DEFAULT_ROWS, MAX_ROWS, default_config, epilogue_allowed, padded_rows
from .pdl import let_dependents_launch, pdl_launch, wait_for_inputs
from .triton_common import device_properties

FP8_WEIGHT = torch.float8_e4m3fn
TABLE_DTYPE = "float8_e4m3fn"  # the tuned table's key for products over an e4m3 weight
ROW_KERNEL = "row"  # config["kernel"]: the one-row CUDA-core kernel; absent: the tensor-core one


def table_rows(rows: int) -> int:
    """The tuned table's row key: 1 for one row (either kernel may win), else the tensor-core
    kernel's padded rows."""
    return 1 if rows == 1 else padded_rows(rows)


ROW_DTYPES = (torch.bfloat16, torch.float16, torch.float32)


def supports_w8a16(x: torch.Tensor, weight: torch.Tensor) -> bool:
    """x [M <= MAX_ROWS, K] in a float dtype and an e4m3 weight [N, K], both contiguous along K."""
    return (x.dim() == 2 and 0 < x.shape[0] <= MAX_ROWS and weight.dim() == 2
            and x.shape[1] == weight.shape[1] and x.stride(1) == 1 and weight.stride(1) == 1
            and x.dtype in ROW_DTYPES and weight.dtype == FP8_WEIGHT)


def w8a16_config(x: torch.Tensor, weight: torch.Tensor) -> dict | None:
    """The launch config for up to DEFAULT_ROWS rows (the weight's one-byte tiles), else None:
    the device's tuned entry for the shape (gemv_table, dtype "float8_e4m3fn"), else the
    default rule."""
    if not supports_w8a16(x, weight) or x.shape[0] > DEFAULT_ROWS:
        return None
    if x.is_cuda:
        name = device_properties(x.device).name
        # One row: its own entry where the sweep made one, else the padded rows' entry.
        for rows in dict.fromkeys((table_rows(x.shape[0]), padded_rows(x.shape[0]))):
            entry = gemv_table.lookup(name, TABLE_DTYPE, weight.shape[0], weight.shape[1], rows)
            if entry is not None:
                return dict(entry["config"])
    shared_memory = device_properties(x.device).shared_memory_per_block_optin if x.is_cuda else 227 * 1024
    return default_config(weight.shape[0], weight.shape[1], 1, shared_memory, x.shape[0])


def w8a16_epilogue_config(x: torch.Tensor, weight: torch.Tensor, group: int, name: str) -> dict | None:
    """The config to run this weight-only product with the fused epilogue `name` ("rope":
    gemv_w8a16_rope, "silu": gemv_w8a16_silu_mul) whose pairs of output features lie `group`
    apart (head_dim / 2; the intermediate size), or None: then gemv_w8a16 (or the W8A8 GEMM) and
    the separate kernel.

    For every step the weight-only kernel takes (w8a16_config: up to DEFAULT_ROWS rows) where the
    epilogue is allowed (gemv_config.set_epilogues, RAYPAGED_GEMM_EPILOGUES). bf16's epilogues start at
    EPILOGUE_MIN_ROWS rows, where this kernel no longer runs; under 17 rows the bf16 step measured
    the same with or without them, and an FP8 weight's GEMM is shorter, so the launch and the
    round trip the epilogue saves weigh more. Not where the device's table chose the one-row
    kernel (it has no epilogue, and beat the tensor-core kernel there). block_n narrows until its
    halves divide `group` (at least 16: tl.dot's minimum)."""
    if not epilogue_allowed(name):
        return None
    config = w8a16_config(x, weight)
    if config is None or config.get("kernel") == ROW_KERNEL:
        return None
    block_n = config["block_n"]
    while block_n >= 16 and group % (block_n // 2):
        block_n //= 2
    return {**config, "block_n": block_n} if block_n >= 16 else None


def _checked(x: torch.Tensor, weight: torch.Tensor, w_scale: torch.Tensor) -> torch.Tensor:
    """The weight scales as the kernel reads them ([N] fp32, contiguous), after checking the
    operands."""
    if not supports_w8a16(x, weight):
        raise ValueError(f"gemv_w8a16 takes x [M <= {MAX_ROWS}, K] (bf16/fp16/fp32) and an e4m3 weight "
                         f"[N, K], contiguous along K; got {tuple(x.shape)} {x.dtype} and "
                         f"{tuple(weight.shape)} {weight.dtype}")
    if w_scale.numel() != weight.shape[0]:
        raise ValueError(f"{w_scale.numel()} weight scales for {weight.shape[0]} output features")
    return w_scale.float().contiguous().view(-1)


def gemv_w8a16(x: torch.Tensor, weight: torch.Tensor, w_scale: torch.Tensor,
               bias: torch.Tensor | None, config: dict) -> torch.Tensor:
    """(x · weightᵀ) · w_scale (+ bias) -> [M, N] in x's dtype, fp32 sums; weight e4m3 [N, K],
    w_scale [N] fp32. `config` from `w8a16_config` (or default_config's fields)."""
    scale = _checked(x, weight, w_scale)
    out = torch.empty(x.shape[0], weight.shape[0], dtype=x.dtype, device=x.device)
    if config.get("kernel") == ROW_KERNEL:
        if x.shape[0] != 1:
            raise ValueError(f"the one-row kernel takes one row, got {x.shape[0]}")
        _launch_one_row(x, weight, scale, bias, out, config)
    else:
        _launch(x, weight, bias, out, config, triton.cdiv(weight.shape[0], config["block_n"]),
                weight_scale=scale)
    return out


def gemv_w8a16_rope(x: torch.Tensor, weight: torch.Tensor, w_scale: torch.Tensor, bias: torch.Tensor | None,
                    cos: torch.Tensor, sin: torch.Tensor, head_dim: int, rotated_features: int,
                    config: dict) -> torch.Tensor:
    """gemv_w8a16's qkv product with its first `rotated_features` features (the q and k heads)
    rotated by rope, by the step's tables cos, sin [M, head_dim / 2] (fp32, contiguous).
    `config` from `w8a16_epilogue_config(x, weight, head_dim // 2, "rope")`."""
    scale = _checked(x, weight, w_scale)
    return launch_rope(x, weight, bias, cos, sin, head_dim, rotated_features, config, weight_scale=scale)


def gemv_w8a16_silu_mul(x: torch.Tensor, weight: torch.Tensor, w_scale: torch.Tensor,
                        bias: torch.Tensor | None, config: dict) -> torch.Tensor:
    """silu(gate) * up of gemv_w8a16's product with a [gate | up] e4m3 weight [2I, K] -> [M, I].
    `config` from `w8a16_epilogue_config(x, weight, I, "silu")`."""
    return launch_silu_mul(x, weight, bias, config, weight_scale=_checked(x, weight, w_scale))


def _launch_one_row(x: torch.Tensor, weight: torch.Tensor, w_scale: torch.Tensor,
                    bias: torch.Tensor | None, out: torch.Tensor, config: dict) -> None:
    out_features, in_features = weight.shape
    block_n, block_k = config["block_n"], config["block_k"]
    _one_row_kernel[(triton.cdiv(out_features, block_n),)](
        x, weight, w_scale, bias if bias is not None else out, out, out_features, in_features,
        weight.stride(0),
        HAS_BIAS=bias is not None, BLOCK_N=block_n, BLOCK_K=block_k,
        EVEN=out_features % block_n == 0 and in_features % block_k == 0,
        num_warps=config["num_warps"], num_stages=config["num_stages"], **pdl_launch(x))


@triton.jit
def _one_row_kernel(x_ptr, w_ptr, w_scale_ptr, bias_ptr, out_ptr, N, K, stride_wn,
                    HAS_BIAS: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                    EVEN: tl.constexpr, USE_PDL: tl.constexpr):
    """out[0, n] = (sum_k x[0, k] * w[n, k]) * w_scale[n] (+ bias[n]) for BLOCK_N features n:
    fp32 products summed per lane across the K loop and once across lanes at the end."""
    wait_for_inputs(USE_PDL)
    cols = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    col_ok = cols < N
    ks = tl.arange(0, BLOCK_K)
    w_ptrs = w_ptr + cols[:, None].to(tl.int64) * stride_wn + ks[None, :]
    acc = tl.zeros([BLOCK_N, BLOCK_K], tl.float32)
    for k0 in range(0, K, BLOCK_K):
        if EVEN:
            w = tl.load(w_ptrs)
            x = tl.load(x_ptr + k0 + ks)
        else:
            k_ok = (k0 + ks) < K
            w = tl.load(w_ptrs, mask=col_ok[:, None] & k_ok[None, :], other=0.0)
            x = tl.load(x_ptr + k0 + ks, mask=k_ok, other=0.0)
        acc += w.to(tl.float32) * x.to(tl.float32)[None, :]
        w_ptrs += BLOCK_K
    total = tl.sum(acc, axis=1) * tl.load(w_scale_ptr + cols, mask=col_ok, other=0.0)
    if HAS_BIAS:
        total += tl.load(bias_ptr + cols, mask=col_ok, other=0.0).to(tl.float32)
    tl.store(out_ptr + cols, total.to(out_ptr.dtype.element_ty), mask=col_ok)
    let_dependents_launch(USE_PDL)
