"""Pieces shared by the Triton attention kernels: the dot-product mode, soft-capping, the SM count."""

from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl
from triton.language.extra import libdevice

from raypaged import envs

LOG2_E = 1.4426950408889634


def dot_mode(x: torch.Tensor) -> str:
    """How `dot` multiplies tiles of x's dtype on x's device.

    fp32 asks for IEEE products (Triton's default is tf32, ~3e-4 relative: over the 1e-4
    budget). The CPU interpreter (Triton 3.9) multiplies bf16 tiles as their raw uint16 bits,
    so there they are widened to fp32 first: the products are exact either way, as on the GPU.
    """
    if x.dtype == torch.float32:
        return "ieee"
    if x.dtype == torch.bfloat16 and x.device.type != "cuda":
        return "widen"
    return "native"


@triton.jit
def dot(a, b, MODE: tl.constexpr):
    """a @ b with fp32 accumulation, as `dot_mode` chose."""
    if MODE == "widen":
        return tl.dot(a.to(tl.float32), b.to(tl.float32), input_precision="ieee")
    elif MODE == "ieee":
        return tl.dot(a, b, input_precision="ieee")
    else:
        return tl.dot(a, b)


@triton.jit
def _tanh_from_sigmoid(x):
    """2 sigmoid(2x) - 1: exact at the tails, and under the interpreter (numpy's exp) near 0 too."""
    return 2.0 * tl.sigmoid(2.0 * x) - 1.0


@triton.jit
def _tanh_libdevice(x):
    """CUDA's tanhf (~1 ulp). The sigmoid form on the GPU's approximate exp loses ~1e-5 of
    tanh's relative precision near 0 to cancellation, enough to flip fp32 greedy tokens."""
    return libdevice.tanh(x)


# Triton decides when a kernel module is imported whether its kernels are interpreted, from the
# same variable; the interpreter has no libdevice.
tanh = _tanh_from_sigmoid if envs.TRITON_INTERPRET else _tanh_libdevice


def softcap_scales(scale: float, softcap: float | None) -> tuple[float, float]:
    """The attention kernels' score arguments: (scale · log2(e), unused) without a soft cap;
    with one, (scale / cap, cap · log2(e)) so a score is tanh(qk · a) · b in the log2 domain."""
    if softcap is None:
        return scale * LOG2_E, 1.0
    return scale / softcap, softcap * LOG2_E


@functools.cache
def _properties(device_index: int):
    return torch.cuda.get_device_properties(device_index)


def device_properties(device: torch.device):
    """torch.cuda.get_device_properties of a CUDA `device` (index or current), asked once."""
    return _properties(device.index if device.index is not None else torch.cuda.current_device())


def num_sms(device: torch.device) -> int:
    """Multiprocessors of `device`; a nominal 4 for the CPU interpreter."""
    if device.type != "cuda":
        return 4
    return device_properties(device).multi_processor_count
