"""FP8 (e4m3) quantization arithmetic: scales, saturating casts, the reference product.

One definition, used by the at-load quantizer, the CPU reference GEMM and the tests, so that
what the checkpoint tools compute (compressed-tensors: scale = amax / 448, q = x / scale cast to
e4m3 after clamping to ±448) and what raypaged computes are the same numbers.

Whether a bare cast of a value beyond e4m3's range gives ±448 or NaN (e4m3fn has no inf)
depends on the torch build and device, so every cast here clamps first: out-of-range values
saturate at ±448, never inf or NaN.
"""

from __future__ import annotations

import torch

FP8_DTYPE = torch.float8_e4m3fn
FP8_MAX = float(torch.finfo(FP8_DTYPE).max)  # 448
# The smallest scale: an all-zero row or token quantizes to zeros instead of dividing by 0.
MIN_SCALE = float(torch.finfo(torch.float32).eps)


def scale_for(amax: torch.Tensor) -> torch.Tensor:
    """The fp32 scale that maps |x| <= amax onto e4m3's range."""
    return (amax.float() / FP8_MAX).clamp(min=MIN_SCALE)


def to_fp8(x: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """x / scale, clamped to ±FP8_MAX, as float8_e4m3fn (scale broadcasts against x)."""
    return (x.float() / scale).clamp(-FP8_MAX, FP8_MAX).to(FP8_DTYPE)


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
    if static_scale is not None:
        scale = static_scale.float().reshape(1, 1).expand(x.shape[0], 1)
    elif per_token:
        scale = scale_for(x.detach().abs().amax(dim=-1, keepdim=True))
    else:
        scale = scale_for(x.detach().abs().amax()).reshape(1, 1).expand(x.shape[0], 1)
    return to_fp8(x, scale), scale.contiguous()


def dequantize(q: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """e4m3 values times their scales (broadcast), in fp32."""
    return q.float() * scale


def scaled_matmul_reference(xq: torch.Tensor, x_scale: torch.Tensor, wq: torch.Tensor,
                            w_scale: torch.Tensor) -> torch.Tensor:
    """The arithmetic of a row-wise scaled FP8 GEMM, in fp32: (xq · wqᵀ) · x_scale · w_scaleᵀ.
    xq [M, K], x_scale [M, 1], wq [N, K], w_scale [N] -> [M, N] fp32."""
    return (xq.float() @ wq.float().t()) * x_scale * w_scale[None, :]
