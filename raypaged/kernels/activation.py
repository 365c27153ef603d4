"""SwiGLU's activation, silu(gate) * up, as one Triton kernel (a program per row and column block).

In decode steps where the skinny GEMM takes the gate/up product, it applies this in its epilogue
instead (gemv_epilogues.py), with the same arithmetic. The kernel rounds silu(gate) to the
activation dtype before the product, as the unfused torch ops do (reference.silu_and_mul_ref).
Callers use ops.silu_and_mul.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .pdl import pdl_launch, wait_for_inputs


@triton.jit
def _silu_and_mul_kernel(
    gate_up_ptr, out_ptr, stride_in, stride_out, n_cols, BLOCK: tl.constexpr, USE_PDL: tl.constexpr
):
    wait_for_inputs(USE_PDL)
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < n_cols
    gate = tl.load(gate_up_ptr + row * stride_in + cols, mask=mask, other=0.0)
    up = tl.load(gate_up_ptr + row * stride_in + n_cols + cols, mask=mask, other=0.0)
    gate32 = gate.to(tl.float32)
    activated = (gate32 * tl.sigmoid(gate32)).to(gate.dtype).to(tl.float32)
    tl.store(out_ptr + row * stride_out + cols, (activated * up.to(tl.float32)).to(gate.dtype), mask=mask)


def silu_and_mul_triton(gate_up: torch.Tensor) -> torch.Tensor:
    """[T, 2I] (gate | up) -> silu(gate) * up, [T, I]."""
    rows, cols = gate_up.shape[0], gate_up.shape[1] // 2
    out = torch.empty((rows, cols), dtype=gate_up.dtype, device=gate_up.device)
    if rows:
        block = min(1024, triton.next_power_of_2(cols))
        _silu_and_mul_kernel[(rows, triton.cdiv(cols, block))](
            gate_up, out, gate_up.stride(0), out.stride(0), cols, BLOCK=block, num_warps=4,
            **pdl_launch(gate_up),
        )
    return out
