"""The skinny GEMM over an FP8 (e4m3) weight: the weight-only product of a decode step's rows.

A decode step's linears are bound by reading their weights; an e4m3 weight halves those bytes.
The rows stay in the model's dtype: each [BLOCK_N, BLOCK_K] weight tile is widened in registers
(e4m3 is exact in bf16, fp16 and fp32) and multiplied as gemv_triton multiplies bf16 tiles, the
fp32 sums scaled by each output feature's scale (model/quantization's per-channel or per-tensor
scales). Quantizing the rows as well (W8A8) would cost a kernel launch per linear for nothing the
memory-bound product needs; the larger steps that are compute-bound take the W8A8 GEMM
(model/quantization/fp8.py, torch._scaled_mm).
"""

from __future__ import annotations

import torch
import triton

from .gemv import _launch
from .gemv_config import DEFAULT_ROWS, MAX_ROWS, default_config
from .triton_common import device_properties

FP8_WEIGHT = torch.float8_e4m3fn
ROW_DTYPES = (torch.bfloat16, torch.float16, torch.float32)


def supports_w8a16(x: torch.Tensor, weight: torch.Tensor) -> bool:
    """x [M <= MAX_ROWS, K] in a float dtype and an e4m3 weight [N, K], both contiguous along K."""
    return (x.dim() == 2 and 0 < x.shape[0] <= MAX_ROWS and weight.dim() == 2
            and x.shape[1] == weight.shape[1] and x.stride(1) == 1 and weight.stride(1) == 1
            and x.dtype in ROW_DTYPES and weight.dtype == FP8_WEIGHT)


def w8a16_config(x: torch.Tensor, weight: torch.Tensor) -> dict | None:
    """The launch config for up to DEFAULT_ROWS rows (the weight's one-byte tiles), else None."""
    if not supports_w8a16(x, weight) or x.shape[0] > DEFAULT_ROWS:
        return None
    shared_memory = device_properties(x.device).shared_memory_per_block_optin if x.is_cuda else 227 * 1024
    return default_config(weight.shape[0], weight.shape[1], 1, shared_memory, x.shape[0])


def gemv_w8a16(x: torch.Tensor, weight: torch.Tensor, w_scale: torch.Tensor,
               bias: torch.Tensor | None, config: dict) -> torch.Tensor:
    """(x · weightᵀ) · w_scale (+ bias) -> [M, N] in x's dtype, fp32 sums; weight e4m3 [N, K],
    w_scale [N] fp32. `config` from `w8a16_config` (or default_config's fields)."""
    if not supports_w8a16(x, weight):
        raise ValueError(f"gemv_w8a16 takes x [M <= {MAX_ROWS}, K] (bf16/fp16/fp32) and an e4m3 weight "
                         f"[N, K], contiguous along K; got {tuple(x.shape)} {x.dtype} and "
                         f"{tuple(weight.shape)} {weight.dtype}")
    if w_scale.numel() != weight.shape[0]:
        raise ValueError(f"{w_scale.numel()} weight scales for {weight.shape[0]} output features")
    out = torch.empty(x.shape[0], weight.shape[0], dtype=x.dtype, device=x.device)
    _launch(x, weight, bias, out, config, triton.cdiv(weight.shape[0], config["block_n"]),
            weight_scale=w_scale.float().contiguous().view(-1))
    return out
