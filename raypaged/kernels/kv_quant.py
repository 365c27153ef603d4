"""The FP8 KV cache's arithmetic: which dtypes a pool may hold, and how K/V are quantized into it
and read back.

A pool of an FP8 dtype (e4m3, or e5m2) holds q = clamp(x / s, ±max) rounded to nearest-even,
with one fp32 scale s per layer for K and one for V (the checkpoint's `k_scale` / `v_scale`, else
1.0). Reading dequantizes: x ≈ q · s. The kernels fold the K scale into the softmax scale
(q·(k s) = (q·k) s) and the V scale into the output (Σ p (v s) = s Σ p v), and widen the FP8
values to the queries' dtype, which holds every e4m3 and e5m2 value exactly. The write kernel,
the references and `quantize_kv` compute the same q bit for bit: IEEE division, clamp, then
`round_to_fp8` (the interpreter's fp32 -> fp8 cast drops the carry when rounding crosses a power
of two; the GPU's cast agrees with this rounding).

The scales are device tensors (one element, fp32) so that nothing reads them on the host: a step
stays free of synchronisation and CUDA-graph capturable.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

FP8_KV_DTYPES = (torch.float8_e4m3fn, torch.float8_e5m2)
# The --kv-cache-dtype names of the FP8 pools ("auto" is the model's dtype).
KV_CACHE_DTYPE_NAMES = {"fp8": torch.float8_e4m3fn, "fp8_e4m3": torch.float8_e4m3fn,
                        "fp8_e5m2": torch.float8_e5m2}


def is_fp8(dtype: torch.dtype) -> bool:
    """Whether a pool of this dtype holds quantized K/V."""
    return dtype in FP8_KV_DTYPES


def fp8_max(dtype: torch.dtype) -> float:
    """The largest finite value of an FP8 dtype (448 for e4m3, 57344 for e5m2)."""
    return float(torch.finfo(dtype).max)


def resolve_kv_cache_dtype(name: str, model_dtype: torch.dtype) -> torch.dtype:
    """The pool's dtype for a --kv-cache-dtype setting: "auto" is the model's own."""
    if name == "auto":
        return model_dtype
    if name not in KV_CACHE_DTYPE_NAMES:
        raise ValueError(f"unknown kv_cache_dtype {name!r}; expected auto or one of "
                         f"{', '.join(KV_CACHE_DTYPE_NAMES)}")
    return KV_CACHE_DTYPE_NAMES[name]


# Triton's FP8 conversions need Ada (8.9) or Hopper (9.0) on.
MIN_CAPABILITY = (8, 9)


class Fp8KvUnsupportedError(ValueError):
    """An FP8 KV cache cannot run on this device."""


def check_kv_cache_device(dtype: torch.dtype, device: torch.device) -> None:
    """Raise unless a pool of `dtype` can run on `device`: an FP8 pool on CUDA needs sm_89+
    (CPU runs the references, or the kernels under the interpreter)."""
    if not is_fp8(dtype) or device.type != "cuda":
        return
    capability = torch.cuda.get_device_capability(device)
    if capability < MIN_CAPABILITY:
        raise Fp8KvUnsupportedError(
            f"an FP8 KV cache ({dtype}) needs compute capability >= 8.9 (Ada or Hopper); "
            f"{torch.cuda.get_device_name(device)} has {capability[0]}.{capability[1]}: use "
            "--kv-cache-dtype auto")


def quantize_kv(x: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """x / scale, clamped to the FP8 range, as `dtype`: out-of-range values saturate, never
    inf or NaN (e4m3fn has no inf; a bare cast may give NaN)."""
    limit = fp8_max(dtype)
    return (x.float() / scale.float()).clamp(-limit, limit).to(dtype)


def dequantize_kv(q: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """FP8 values times their scale, in fp32."""
    return q.float() * scale.float()


def round_fp8_args(dtype: torch.dtype) -> dict:
    """The constexprs `quantize_fp8_tile` takes for a pool of `dtype` (unused, and fixed, for a
    float pool)."""
    return {"FP8_MAX": fp8_max(dtype) if is_fp8(dtype) else 0.0, "E5M2": dtype == torch.float8_e5m2}


@triton.jit
def round_to_fp8(v, E5M2: tl.constexpr):
    """v (fp32, within the dtype's range) rounded to nearest-even at e4m3's (or e5m2's)
    precision, in fp32, so the cast that follows is exact. Normal values keep 3 (2) of fp32's 23
    mantissa bits, a carry moving into the exponent; subnormals are multiples of 2^-9 (2^-16),
    fp32's ulp at 1.5 * 2^14 (1.5 * 2^7). Literals here, not module constants: kernels compiled
    for the GPU may not read module-level Python numbers."""
    bits = v.to(tl.int32, bitcast=True)
    if E5M2:
        lsb = (bits >> 21) & 1
        normal = ((bits + 0xFFFFF + lsb) & -2097152).to(tl.float32, bitcast=True)
        subnormal = (v + 192.0) - 192.0
        min_normal = 6.103515625e-05
    else:
        lsb = (bits >> 20) & 1
        normal = ((bits + 0x7FFFF + lsb) & -1048576).to(tl.float32, bitcast=True)
        subnormal = (v + 24576.0) - 24576.0
        min_normal = 0.015625
    subnormal = tl.where(subnormal == 0.0, v * 0.0, subnormal)  # keep the sign of a zero
    return tl.where(tl.abs(v) < min_normal, subnormal, normal)


@triton.jit
def quantize_fp8_tile(x, scale, FP8_MAX: tl.constexpr, E5M2: tl.constexpr):
    """A tile of K or V quantized with its layer's scale, in fp32 (cast it to the pool's dtype):
    `quantize_kv`'s numbers."""
    q = tl.clamp(tl.div_rn(x.to(tl.float32), scale), -FP8_MAX, FP8_MAX)
    return round_to_fp8(q, E5M2)
