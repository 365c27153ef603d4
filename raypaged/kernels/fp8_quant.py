"""Quantize activation rows to FP8 (e4m3) in one kernel: each row's amax, its scale, and the
saturated e4m3 values, for the FP8 linears (model/quantization/fp8.py) on the Triton backend.

`quantize_rows_ref` is the arithmetic in torch ops (the CPU path and the test oracle; also
model/quantization/numerics.py's building blocks). As torch ops it is five or six kernels per
linear (abs, amax, divide, clamp, cast, the
scale's clamp); in a decode step, with seven FP8 linears a layer, their launches would cost more
than the weight bytes FP8 saves. The arithmetic is the reference's (quantization/numerics.py):
scale = max(amax / 448, eps), q = clamp(x / scale, ±448) rounded to nearest — both divisions
IEEE-rounded (div_rn), so the values are bit for bit the reference's. Whether a bare cast of a
value beyond e4m3's range gives ±448 or NaN (e4m3fn has no inf) depends on the torch build and
the device, so every cast clamps first: out-of-range values saturate, never inf or NaN.
Callers use ops.quantize_fp8.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .pdl import pdl_launch, wait_for_inputs

FP8_DTYPE = torch.float8_e4m3fn
FP8_MAX = float(torch.finfo(FP8_DTYPE).max)  # 448
# The smallest scale: an all-zero row quantizes to zeros instead of dividing by 0.
MIN_SCALE = float(torch.finfo(torch.float32).eps)
_MAX_BLOCK = 4096


def scale_for(amax: torch.Tensor) -> torch.Tensor:
    """The fp32 scale that maps |x| <= amax onto e4m3's range. The divisor is a tensor, not a
    Python number: CUDA torch turns division by a scalar into multiplication by its (rounded)
    reciprocal, one ulp off the IEEE quotient the kernel's div_rn and the CPU give."""
    amax = amax.float()
    return (amax / torch.full_like(amax, FP8_MAX)).clamp(min=MIN_SCALE)


def to_fp8(x: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """x / scale, clamped to ±FP8_MAX, as float8_e4m3fn (scale broadcasts against x)."""
    return (x.float() / scale).clamp(-FP8_MAX, FP8_MAX).to(FP8_DTYPE)


def quantize_rows_ref(x: torch.Tensor, static_scale: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """The torch reference of `quantize_fp8_triton`."""
    if static_scale is not None:
        scale = static_scale.float().reshape(1, 1).expand(x.shape[0], 1).contiguous()
    else:
        scale = scale_for(x.detach().abs().amax(dim=-1, keepdim=True))
    return to_fp8(x, scale), scale


@triton.jit
def _round_to_e4m3(v):
    """v (fp32, within ±448) rounded to nearest-even at e4m3's precision, in fp32: the cast that
    follows is then exact. Done here, not left to the cast, because the interpreter's fp32 -> e4m3
    cast drops the carry when rounding up crosses a power of two (126.2 became 64); the GPU's
    cast would give the same value."""
    bits = v.to(tl.int32, bitcast=True)
    # Normal e4m3 (|v| >= 2^-6): keep 3 of fp32's 23 mantissa bits; a carry moves into the exponent.
    lsb = (bits >> 20) & 1
    normal = ((bits + 0x7FFFF + lsb) & -1048576).to(tl.float32, bitcast=True)
    # Subnormal e4m3: multiples of 2^-9, fp32's ulp at 1.5 * 2^14.
    subnormal = (v + 24576.0) - 24576.0
    subnormal = tl.where(subnormal == 0.0, v * 0.0, subnormal)  # keep the sign of a zero
    return tl.where(tl.abs(v) < 0.015625, subnormal, normal)


@triton.jit
def _quantize_rows_kernel(x_ptr, q_ptr, scale_ptr, static_ptr, K, stride_x, stride_q,
                          FP8_MAX: tl.constexpr, MIN_SCALE: tl.constexpr, BLOCK: tl.constexpr,
                          STATIC: tl.constexpr, USE_PDL: tl.constexpr):
    wait_for_inputs(USE_PDL)
    row = tl.program_id(0).to(tl.int64)
    lanes = tl.arange(0, BLOCK)
    if STATIC:
        scale = tl.load(static_ptr).to(tl.float32)
    else:
        peak = tl.zeros([BLOCK], tl.float32)
        for k0 in range(0, K, BLOCK):
            x = tl.load(x_ptr + row * stride_x + k0 + lanes, mask=k0 + lanes < K, other=0.0)
            peak = tl.maximum(peak, tl.abs(x.to(tl.float32)))
        scale = tl.maximum(tl.div_rn(tl.max(peak, axis=0), FP8_MAX), MIN_SCALE)
    tl.store(scale_ptr + row, scale)
    for k0 in range(0, K, BLOCK):
        mask = k0 + lanes < K
        x = tl.load(x_ptr + row * stride_x + k0 + lanes, mask=mask, other=0.0)
        q = _round_to_e4m3(tl.clamp(tl.div_rn(x.to(tl.float32), scale), -FP8_MAX, FP8_MAX))
        tl.store(q_ptr + row * stride_q + k0 + lanes, q.to(q_ptr.dtype.element_ty), mask=mask)


def quantize_fp8_triton(x: torch.Tensor, static_scale: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """x [M, K] (last dim contiguous) -> (e4m3 [M, K], scales [M, 1] fp32): per token from each
    row's amax, or every row with `static_scale` (a 1-element fp32 tensor)."""
    if x.dim() != 2 or x.stride(1) != 1:
        raise ValueError(f"quantize_fp8 takes [M, K] rows contiguous along K, got {tuple(x.shape)}")
    rows, cols = x.shape
    q = torch.empty(rows, cols, dtype=torch.float8_e4m3fn, device=x.device)
    scale = torch.empty(rows, 1, dtype=torch.float32, device=x.device)
    if rows:
        block = min(_MAX_BLOCK, triton.next_power_of_2(cols))
        _quantize_rows_kernel[(rows,)](
            x, q, scale, static_scale if static_scale is not None else scale, cols, x.stride(0), q.stride(0),
            FP8_MAX=FP8_MAX, MIN_SCALE=MIN_SCALE, BLOCK=block, STATIC=static_scale is not None,
            num_warps=4, **pdl_launch(x),
        )
    return q, scale
