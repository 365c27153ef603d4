"""FP8 (e4m3) quantization arithmetic: scales, saturating casts, the reference product.

One definition, used by the at-load quantizer, the CPU reference GEMM and the tests, so that
what the checkpoint tools compute (compressed-tensors: scale = amax / 448, q = x / scale cast to
e4m3 after clamping to ±448) and what raypaged computes are the same numbers.

The elementary steps (the scale of an amax, the saturating cast, a row's quantization) are
kernels/fp8_quant.py's, whose Triton kernel computes the same: every cast clamps first, so
out-of-range values saturate at ±448, never inf or NaN.
"""

from __future__ import annotations

import torch

from raypaged.kernels.fp8_quant import FP8_DTYPE, FP8_MAX, MIN_SCALE, quantize_rows_ref, scale_for, to_fp8

__all__ = ["FP8_DTYPE", "FP8_MAX", "MIN_SCALE", "dequantize", "grouped_w8a8_reference", "per_channel_amax",
           "quantize_activation", "quantize_groups", "quantize_weight", "scale_for", "scaled_matmul_reference",
           "to_fp8", "weight_only_matmul_reference"]


def per_channel_amax(weight: torch.Tensor) -> torch.Tensor:
    """|W|'s max of each output row [N, K] -> [N] (fp32). NaN rows stay NaN (not hidden)."""
    return weight.detach().abs().amax(dim=1).float()


def quantize_weight(weight: torch.Tensor, amax: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """W [N, K] -> (e4m3 [N, K], per-output-channel scales [N] fp32). `amax` [N]: the rows'
    maxima when they span more than this tensor (a row-parallel shard's full rows)."""
    scale = scale_for(per_channel_amax(weight) if amax is None else amax)
    return to_fp8(weight, scale[:, None]), scale


def quantize_activation(x: torch.Tensor, static_scale: torch.Tensor | None = None,
                        per_token: bool = True) -> tuple[torch.Tensor, torch.Tensor]:
    """x [M, K] -> (e4m3 [M, K], scales [M, 1] fp32): one scale per token (dynamic), one for
    the whole tensor (dynamic, per_token=False), or the checkpoint's static scale."""
    if static_scale is not None or per_token:
        return quantize_rows_ref(x, static_scale)
    scale = scale_for(x.detach().abs().amax()).reshape(1, 1).expand(x.shape[0], 1).contiguous()
    return to_fp8(x, scale), scale


def dequantize(q: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """e4m3 values times their scales (broadcast), in fp32."""
    return q.float() * scale


def scaled_matmul_reference(xq: torch.Tensor, x_scale: torch.Tensor, wq: torch.Tensor,
                            w_scale: torch.Tensor) -> torch.Tensor:
    """The arithmetic of a row-wise scaled FP8 GEMM, in fp32: (xq · wqᵀ) · x_scale · w_scaleᵀ.
    xq [M, K], x_scale [M, 1], wq [N, K], w_scale [N] -> [M, N] fp32."""
    return (xq.float() @ wq.float().t()) * x_scale * w_scale[None, :]


def weight_only_matmul_reference(x: torch.Tensor, wq: torch.Tensor, w_scale: torch.Tensor) -> torch.Tensor:
    """The skinny FP8 GEMM's arithmetic (kernels/gemv_fp8.py), in fp32: (x · wqᵀ) · w_scaleᵀ,
    the rows unquantized. x [M, K], wq [N, K] e4m3, w_scale [N] -> [M, N] fp32."""
    return (x.float() @ wq.float().t()) * w_scale[None, :]


def quantize_groups(x: torch.Tensor, group: int) -> tuple[torch.Tensor, torch.Tensor]:
    """x [M, K] -> (e4m3 [M, K], scales [M, ceil(K / group)] fp32): one scale per row and group
    of `group` consecutive columns (the last group may be shorter), as the fused W8A8 kernel
    quantizes its x tiles (kernels/gemm_w8a8.py): scale = scale_for(the group's amax) and
    q = x · (1 / scale), clamped to ±FP8_MAX and rounded to nearest-even. The reciprocal, not a
    division per element: the kernel divides once a group and multiplies, and so does this."""
    rows, cols = x.shape
    groups = -(-cols // group)
    padded = torch.zeros(rows, groups * group, dtype=torch.float32, device=x.device)
    padded[:, :cols] = x.detach().float()
    padded = padded.view(rows, groups, group)
    scale = scale_for(padded.abs().amax(dim=-1))
    inverse = torch.ones_like(scale) / scale
    q = (padded * inverse[..., None]).clamp(-FP8_MAX, FP8_MAX).to(FP8_DTYPE)
    return q.view(rows, groups * group)[:, :cols], scale


def grouped_w8a8_reference(x: torch.Tensor, weight: torch.Tensor, w_scale: torch.Tensor, group: int) -> torch.Tensor:
    """The fused W8A8 kernel's arithmetic (kernels/gemm_w8a8.py), in fp32: x quantized per (row,
    group of K) by `quantize_groups`, each group's product with the e4m3 weight [N, K] scaled by
    its row's scale and summed, then times w_scale [N]. x [M, K] -> [M, N] fp32 (no bias)."""
    q, scale = quantize_groups(x, group)
    out = torch.zeros(x.shape[0], weight.shape[0], dtype=torch.float32, device=x.device)
    w = weight.float()
    for g in range(scale.shape[1]):
        cols = slice(g * group, (g + 1) * group)
        out += (q[:, cols].float() @ w[:, cols].t()) * scale[:, g : g + 1]
    return out * w_scale.float()[None, :]
