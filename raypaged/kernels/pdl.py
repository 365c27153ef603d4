"""Programmatic dependent launch (PDL) for the Triton kernels of a decode step.

A decode step at batch 1 is ~350 small kernels back to back (an 8B model on the H200: the GPU
busy 95% of the step, benchmarks/README.md), and each boundary costs the next kernel's launch
and ramp while the previous one drains. With PDL (Hopper and later) a kernel may be launched
while its predecessor still runs: its programs start, wait at `wait_for_inputs` until the
predecessor has finished and its writes are visible, and meanwhile the launch work is done. Every
kernel launched this way calls `wait_for_inputs` before it touches memory (inputs or outputs: in a
CUDA graph an output buffer may be one the predecessor still reads), so the order of effects is
the stream's, as without PDL.

On wherever the device (compute capability 9+) and Triton support it, unless turned off:
KernelSettings.pdl (`--no-pdl`, applied by the worker through set_enabled) or RAYPAGED_PDL=0.
It shortens the decode step most at small batches (benchmarks/README.md).
"""

from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl

from raypaged import envs

from .triton_common import device_properties

_allowed = True  # set_enabled's; RAYPAGED_PDL=0 overrides it


def _triton_has_pdl() -> bool:
    """Triton >= 3.3 or so: the launch option and the in-kernel wait."""
    try:
        from triton.backends.nvidia.compiler import CUDAOptions
    except ImportError:
        return False
    return "launch_pdl" in CUDAOptions.__dataclass_fields__ and hasattr(tl.extra.cuda, "gdc_wait")


def set_enabled(enabled: bool) -> None:
    """Allow PDL (where the device has it) for the kernels launched from now on, in this process.
    Set before the model's CUDA graphs are captured: they keep the launches they recorded."""
    global _allowed
    _allowed = enabled
    _enabled.cache_clear()


def supported(device: torch.device) -> bool:
    """Whether PDL can run on `device` at all, whatever the settings say: a CUDA GPU of compute
    capability 9 or more, and a Triton that has the launch option and the wait."""
    return device.type == "cuda" and device_properties(device).major >= 9 and _triton_has_pdl()


@functools.cache
def _enabled(device: torch.device) -> bool:
    if not (_allowed and envs.RAYPAGED_PDL):
        return False
    return supported(device)


def pdl_launch(x: torch.Tensor) -> dict:
    """Keyword arguments for launching a kernel that calls `wait_for_inputs(USE_PDL)`, on x's
    device: USE_PDL, and launch_pdl where it is on."""
    if x.is_cuda and _enabled(x.device):
        return {"USE_PDL": True, "launch_pdl": True}
    return {"USE_PDL": False}


@triton.jit
def wait_for_inputs(USE_PDL: tl.constexpr):
    """The first thing a kernel does: with PDL, wait until the previous kernel in the stream has
    finished (its writes visible), then let the next one launch."""
    wait_only(USE_PDL)
    let_dependents_launch(USE_PDL)


@triton.jit
def wait_only(USE_PDL: tl.constexpr):
    """`wait_for_inputs` without letting the next kernel launch yet: a kernel that calls this
    calls `let_dependents_launch` later itself (gemv._dependents_at_end says when)."""
    if USE_PDL:
        tl.extra.cuda.gdc_wait()


@triton.jit
def let_dependents_launch(USE_PDL: tl.constexpr):
    """With PDL, let the next kernel in the stream launch (its programs then wait for this one
    to finish in their own `wait_for_inputs`)."""
    if USE_PDL:
        tl.extra.cuda.gdc_launch_dependents()
