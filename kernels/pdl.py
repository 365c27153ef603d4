"""Programmatic dependent launch (PDL) for the Triton kernels of a decode step. Off by default.

A decode step at batch 1 is ~350 small kernels back to back (an 8B model on the H200: the GPU
busy 95% of the step, benchmarks/README.md), and each boundary costs the next kernel's launch
and ramp while the previous one drains. With PDL (Hopper and later) a kernel may be launched
while its predecessor still runs: its programs start, wait at `wait_for_inputs` until the
predecessor has finished and its writes are visible, and meanwhile the launch work is done. Every
kernel launched this way calls `wait_for_inputs` before it touches memory (inputs or outputs: in a
CUDA graph an output buffer may be one the predecessor still reads), so the order of effects is
the stream's, as without PDL.

RAYPAGED_PDL=1 turns it on where the device and Triton support it. Not yet measured on a GPU (the
session that wrote it had no device time left): `scripts/gpu_pdl.sh` runs the GPU tests with it
and times the engine's decode step with it off and on in one call; the default follows that.
"""

from __future__ import annotations

import functools
import os

import torch
import triton
import triton.language as tl

from .triton_common import device_properties

ENV_VAR = "RAYPAGED_PDL"


def _triton_has_pdl() -> bool:
    """Triton >= 3.3 or so: the launch option and the in-kernel wait."""
    try:
        from triton.backends.nvidia.compiler import CUDAOptions
    except ImportError:
        return False
    return "launch_pdl" in CUDAOptions.__dataclass_fields__ and hasattr(tl.extra.cuda, "gdc_wait")


@functools.lru_cache(maxsize=None)
def _enabled(device: torch.device) -> bool:
    if os.environ.get(ENV_VAR) != "1":
        return False
    return device_properties(device).major >= 9 and _triton_has_pdl()


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
    if USE_PDL:
        tl.extra.cuda.gdc_wait()
        tl.extra.cuda.gdc_launch_dependents()


@triton.jit
def prefetch_to_l2(ptrs):
    """Ask the lines at `ptrs` into L2 without waiting for them (PTX prefetch): before
    `wait_for_inputs`, for data no earlier kernel writes, such as weights. GPU only."""
    tl.inline_asm_elementwise("prefetch.global.L2 [$1];\n\tmov.u32 $0, 0;", "=r,l", [ptrs],
                              dtype=tl.int32, is_pure=False, pack=1)
