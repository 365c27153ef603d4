"""Rotary position embedding (Hugging Face's "rotate half" layout) as two Triton kernels: the
step's cos/sin tables, computed once a step, and the rotation of q and k in place by them.

Every layer's rope reads the same tables: this rotation, or the qkv GEMM's epilogue
(gemv_epilogues.py) where the skinny GEMM takes the product. Both compute in fp32 and round once
(reference.rope_tables_ref / rope_in_place_ref). Callers use ops.rope_tables / ops.rope_in_place.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .pdl import pdl_launch, wait_for_inputs


@triton.jit
def _rope_table_kernel(positions_ptr, inv_freq_ptr, cos_ptr, sin_ptr, HALF: tl.constexpr,
                       HALF_PAD: tl.constexpr, USE_PDL: tl.constexpr):
    wait_for_inputs(USE_PDL)
    token = tl.program_id(0).to(tl.int64)
    dims = tl.arange(0, HALF_PAD)
    mask = dims < HALF
    angle = tl.load(positions_ptr + token).to(tl.float32) * tl.load(inv_freq_ptr + dims, mask=mask)
    tl.store(cos_ptr + token * HALF + dims, tl.cos(angle), mask=mask)
    tl.store(sin_ptr + token * HALF + dims, tl.sin(angle), mask=mask)


def rope_tables_triton(positions: torch.Tensor,
                       inv_freq: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sin of position · inv_freq, fp32 [T, D/2]: computed once a step, read by every
    layer's rope (here, or in the qkv GEMM's epilogue, kernels/gemv_epilogues.py), which then
    does no trigonometry of its own (in a GEMM's epilogue the precise sin/cos made ptxas keep
    local memory, and the qkv GEMM slower)."""
    tokens, half = positions.shape[0], inv_freq.shape[0]
    cos = torch.empty(tokens, half, dtype=torch.float32, device=positions.device)
    sin = torch.empty_like(cos)
    if tokens:
        _rope_table_kernel[(tokens,)](
            positions, inv_freq, cos, sin, HALF=half, HALF_PAD=triton.next_power_of_2(half),
            num_warps=1, **pdl_launch(positions),
        )
    return cos, sin


@triton.jit
def _rope_kernel(
    q_ptr, k_ptr, cos_ptr, sin_ptr,
    stride_q_token, stride_q_head, stride_k_token, stride_k_head,
    num_q_heads, HALF: tl.constexpr, HALF_PAD: tl.constexpr, USE_PDL: tl.constexpr,
):  # fmt: skip
    wait_for_inputs(USE_PDL)
    token = tl.program_id(0).to(tl.int64)
    head = tl.program_id(1)
    if head < num_q_heads:
        base = q_ptr + token * stride_q_token + head * stride_q_head
    else:
        base = k_ptr + token * stride_k_token + (head - num_q_heads) * stride_k_head
    dims = tl.arange(0, HALF_PAD)
    mask = dims < HALF
    cos = tl.load(cos_ptr + token * HALF + dims, mask=mask)
    sin = tl.load(sin_ptr + token * HALF + dims, mask=mask)
    # "rotate half" layout: dims i and i + D/2 form one rotated pair.
    x1 = tl.load(base + dims, mask=mask)
    x2 = tl.load(base + HALF + dims, mask=mask)
    a, b = x1.to(tl.float32), x2.to(tl.float32)
    tl.store(base + dims, (a * cos - b * sin).to(x1.dtype), mask=mask)
    tl.store(base + HALF + dims, (b * cos + a * sin).to(x1.dtype), mask=mask)


def rope_in_place_triton(query: torch.Tensor, key: torch.Tensor, cos: torch.Tensor,
                         sin: torch.Tensor) -> None:
    """Rotate query [T, Hq, D] and key [T, Hkv, D] (views, last dim contiguous) in place by the
    tables of `rope_tables_triton` ([T, D/2] fp32, contiguous)."""
    tokens, num_q_heads, head_dim = query.shape
    if query.stride(-1) != 1 or key.stride(-1) != 1:
        raise ValueError("rope_in_place needs the head dim contiguous")
    if tokens:
        half = head_dim // 2
        _rope_kernel[(tokens, num_q_heads + key.shape[1])](
            query, key, cos, sin,
            query.stride(0), query.stride(1), key.stride(0), key.stride(1),
            num_q_heads, HALF=half, HALF_PAD=triton.next_power_of_2(half), num_warps=1,
            **pdl_launch(query),
        )  # fmt: skip
