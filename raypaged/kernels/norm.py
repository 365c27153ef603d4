"""RMSNorm, alone or after the residual add, as one Triton kernel (one program per token row).

Unfused, the add and the norm are 4–10 small kernels; in a decode step, where the GEMMs only
stream weights, those launches and round trips cost as much as a third of the step on an H200.
The kernel computes in fp32 and rounds once, so in bf16 it differs from transformers (whose exact
arithmetic is reference.rms_norm_ref, the CPU path) by rounding only. Gemma's variant (unit_offset)
scales by (1 + weight) in fp32 and rounds only the product, as transformers' Gemma2RMSNorm does
(reference.gemma_rms_norm_ref). Callers use ops.rms_norm / ops.add_rms_norm.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .pdl import pdl_launch, wait_for_inputs


@triton.jit
def _rms_norm_kernel(
    x_ptr, residual_ptr, weight_ptr, out_ptr, residual_out_ptr,
    stride_x, stride_residual, stride_out, stride_residual_out,
    n_cols, eps,
    HAS_RESIDUAL: tl.constexpr, UNIT_OFFSET: tl.constexpr, BLOCK: tl.constexpr,
    USE_PDL: tl.constexpr,
):  # fmt: skip
    wait_for_inputs(USE_PDL)
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    mask = cols < n_cols
    x = tl.load(x_ptr + row * stride_x + cols, mask=mask, other=0.0)
    if HAS_RESIDUAL:
        residual = tl.load(residual_ptr + row * stride_residual + cols, mask=mask, other=0.0)
        # The sum is rounded to the activation dtype, as the unfused add would.
        x = (x.to(tl.float32) + residual.to(tl.float32)).to(x.dtype)
        tl.store(residual_out_ptr + row * stride_residual_out + cols, x, mask=mask)
    x32 = x.to(tl.float32)
    inv_rms = tl.rsqrt(tl.sum(x32 * x32, axis=0) / n_cols + eps)
    weight = tl.load(weight_ptr + cols, mask=mask, other=0.0).to(tl.float32)
    if UNIT_OFFSET:
        out = x32 * inv_rms * (1.0 + weight)
    else:
        out = weight * (x32 * inv_rms).to(x.dtype).to(tl.float32)
    tl.store(out_ptr + row * stride_out + cols, out.to(out_ptr.dtype.element_ty), mask=mask)


def _rms_norm_launch(
    x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor, eps: float,
    unit_offset: bool,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    rows, cols = x.shape
    # transformers multiplies a weight of the model dtype by the normalised activations (Llama),
    # or rounds the fp32 product to the activations' dtype (Gemma).
    dtype = x.dtype if unit_offset else torch.promote_types(weight.dtype, x.dtype)
    out = torch.empty((rows, cols), dtype=dtype, device=x.device)
    residual_out = torch.empty_like(x) if residual is not None else None
    if rows:
        block = triton.next_power_of_2(cols)
        _rms_norm_kernel[(rows,)](
            x, residual if residual is not None else x, weight, out,
            residual_out if residual_out is not None else out,
            x.stride(0), (residual if residual is not None else x).stride(0), out.stride(0),
            (residual_out if residual_out is not None else out).stride(0),
            cols, eps,
            HAS_RESIDUAL=residual is not None, UNIT_OFFSET=unit_offset, BLOCK=block,
            num_warps=min(16, max(1, block // 256)), **pdl_launch(x),
        )  # fmt: skip
    return out, residual_out


def rms_norm_triton(x: torch.Tensor, weight: torch.Tensor, eps: float,
                    unit_offset: bool = False) -> torch.Tensor:
    """weight * x / rms(x) over the last dim ((1 + weight) with unit_offset); x [T, H] (rows may
    be strided, the last dim not)."""
    return _rms_norm_launch(x, None, weight, eps, unit_offset)[0]


def add_rms_norm_triton(
    x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float,
    unit_offset: bool = False,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(rms_norm(x + residual), x + residual), the sum rounded to x's dtype; x, residual [T, H]."""
    out, summed = _rms_norm_launch(x, residual, weight, eps, unit_offset)
    assert summed is not None
    return out, summed
