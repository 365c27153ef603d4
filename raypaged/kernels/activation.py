"""The gated MLPs' activations as one Triton kernel (a program per row and column block):
SwiGLU's silu(gate) * up and Gemma's GeGLU, gelu_tanh(gate) * up.

In decode steps where the skinny GEMM takes the gate/up product, it applies SwiGLU in its epilogue
instead (gemv_epilogues.py), with the same arithmetic. The kernel rounds the activation to the
activations' dtype before the product, as the unfused torch ops do (reference.silu_and_mul_ref,
reference.gelu_tanh_and_mul_ref). Callers use ops.silu_and_mul / ops.gelu_tanh_and_mul.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .pdl import pdl_launch, wait_for_inputs


@triton.jit
def _silu_and_mul_kernel(
    gate_up_ptr, out_ptr, stride_in, stride_out, n_cols, GELU_TANH: tl.constexpr, BLOCK: tl.constexpr,
    USE_PDL: tl.constexpr,
):
    wait_for_inputs(USE_PDL)
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < n_cols
    gate = tl.load(gate_up_ptr + row * stride_in + cols, mask=mask, other=0.0)
    up = tl.load(gate_up_ptr + row * stride_in + n_cols + cols, mask=mask, other=0.0)
    gate32 = gate.to(tl.float32)
    if GELU_TANH:
        # tanh(y) = 2·sigmoid(2y) - 1: exact to fp32 rounding, and the interpreter has no tanh.
        inner = 0.7978845608028654 * (gate32 + 0.044715 * gate32 * gate32 * gate32)
        activated32 = 0.5 * gate32 * (2.0 * tl.sigmoid(2.0 * inner))
    else:
        activated32 = gate32 * tl.sigmoid(gate32)
    activated = activated32.to(gate.dtype).to(tl.float32)
    tl.store(out_ptr + row * stride_out + cols, (activated * up.to(tl.float32)).to(gate.dtype), mask=mask)


def silu_and_mul_triton(gate_up: torch.Tensor) -> torch.Tensor:
    """[T, 2I] (gate | up) -> silu(gate) * up, [T, I]."""
    return _gated_activation(gate_up, gelu_tanh=False)


def gelu_tanh_and_mul_triton(gate_up: torch.Tensor) -> torch.Tensor:
    """[T, 2I] (gate | up) -> gelu_tanh(gate) * up, [T, I]."""
    return _gated_activation(gate_up, gelu_tanh=True)


def _gated_activation(gate_up: torch.Tensor, gelu_tanh: bool) -> torch.Tensor:
    rows, cols = gate_up.shape[0], gate_up.shape[1] // 2
    out = torch.empty((rows, cols), dtype=gate_up.dtype, device=gate_up.device)
    if rows:
        block = min(1024, triton.next_power_of_2(cols))
        _silu_and_mul_kernel[(rows, triton.cdiv(cols, block))](
            gate_up, out, gate_up.stride(0), out.stride(0), cols, GELU_TANH=gelu_tanh, BLOCK=block, num_warps=4,
            **pdl_launch(gate_up),
        )
    return out
