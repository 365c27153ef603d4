"""The decoder's elementwise steps, fused: RMSNorm (with the residual add), SiLU·mul, RoPE.

Unfused, each is 4–10 small kernels; in a decode step, where the GEMMs only stream weights, those
launches and round trips cost as much as a third of the step on an H200. So on CUDA each runs as
one Triton kernel (one program per token row), and RoPE rotates q and k in place by cos/sin
tables computed once a step. In steps of 17-64 rows where the GPU's GEMM table has the shapes,
SiLU·mul and RoPE run in the epilogue of the GEMM before them instead (raypaged/kernels/gemv_epilogues.py,
called through layers.py), with the same arithmetic.

On CPU the torch versions run: they are transformers' exact arithmetic (round to the activation
dtype where transformers does), which the CPU tests compare against tightly. The Triton versions
compute in fp32 and round once, so in bf16 they differ from transformers by rounding only.
`use_triton(x)` picks; tests force the Triton path under TRITON_INTERPRET=1.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from raypaged.kernels.pdl import pdl_launch, wait_for_inputs

_force_triton = False


def set_force_triton(enabled: bool) -> None:
    """Run the Triton versions even on CPU tensors (the interpreter; for tests)."""
    global _force_triton
    _force_triton = enabled


def use_triton(x: torch.Tensor) -> bool:
    return _force_triton or x.is_cuda


# -- RMSNorm -----------------------------------------------------------------------------------


def rms_norm_torch(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    x32 = x.float()
    normed = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)
    return weight * normed.to(x.dtype)


@triton.jit
def _rms_norm_kernel(
    x_ptr, residual_ptr, weight_ptr, out_ptr, residual_out_ptr,
    stride_x, stride_residual, stride_out, stride_residual_out,
    n_cols, eps,
    HAS_RESIDUAL: tl.constexpr, BLOCK: tl.constexpr, USE_PDL: tl.constexpr,
):  # fmt: skip
    wait_for_inputs(USE_PDL)
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    mask = cols < n_cols
    x = tl.load(x_ptr + row * stride_x + cols, mask=mask, other=0.0)
    if HAS_RESIDUAL:
        residual = tl.load(residual_ptr + row * stride_residual + cols, mask=mask, other=0.0)
        # The sum is rounded to the activation dtype, as the unfused add would.
        x = (x.to(tl.float32) + residual.to(tl.float32)).to(x.dtype)
        tl.store(residual_out_ptr + row * stride_residual_out + cols, x, mask=mask)
    x32 = x.to(tl.float32)
    inv_rms = tl.rsqrt(tl.sum(x32 * x32, axis=0) / n_cols + eps)
    normed = (x32 * inv_rms).to(x.dtype).to(tl.float32)
    weight = tl.load(weight_ptr + cols, mask=mask, other=0.0).to(tl.float32)
    tl.store(out_ptr + row * stride_out + cols, (weight * normed).to(out_ptr.dtype.element_ty), mask=mask)


def _rms_norm_triton(
    x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor | None]:
    rows, cols = x.shape
    # transformers multiplies a weight of the model dtype by the normalised activations.
    out = torch.empty((rows, cols), dtype=torch.promote_types(weight.dtype, x.dtype), device=x.device)
    residual_out = torch.empty_like(x) if residual is not None else None
    if rows:
        block = triton.next_power_of_2(cols)
        _rms_norm_kernel[(rows,)](
            x, residual if residual is not None else x, weight, out,
            residual_out if residual_out is not None else out,
            x.stride(0), (residual if residual is not None else x).stride(0), out.stride(0),
            (residual_out if residual_out is not None else out).stride(0),
            cols, eps,
            HAS_RESIDUAL=residual is not None, BLOCK=block,
            num_warps=min(16, max(1, block // 256)), **pdl_launch(x),
        )  # fmt: skip
    return out, residual_out


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """weight * x / rms(x) over the last dim; x [T, H]."""
    if use_triton(x):
        return _rms_norm_triton(x, None, weight, eps)[0]
    return rms_norm_torch(x, weight, eps)


def add_rms_norm(
    x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """(rms_norm(x + residual), x + residual); x, residual [T, H]."""
    if use_triton(x):
        out, summed = _rms_norm_triton(x, residual, weight, eps)
        assert summed is not None
        return out, summed
    summed = residual + x
    return rms_norm_torch(summed, weight, eps), summed


# -- SiLU and mul ------------------------------------------------------------------------------


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


def silu_and_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """[T, 2I] (gate | up) -> silu(gate) * up, [T, I]."""
    if not use_triton(gate_up):
        gate, up = gate_up.chunk(2, dim=-1)
        return F.silu(gate) * up
    rows, cols = gate_up.shape[0], gate_up.shape[1] // 2
    out = torch.empty((rows, cols), dtype=gate_up.dtype, device=gate_up.device)
    if rows:
        block = min(1024, triton.next_power_of_2(cols))
        _silu_and_mul_kernel[(rows, triton.cdiv(cols, block))](
            gate_up, out, gate_up.stride(0), out.stride(0), cols, BLOCK=block, num_warps=4,
            **pdl_launch(gate_up),
        )
    return out


# -- rotary embedding --------------------------------------------------------------------------


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


def rope_tables(positions: torch.Tensor, inv_freq: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sin of position · inv_freq, fp32 [T, D/2]: computed once a step, read by every
    layer's rope (here, or in the qkv GEMM's epilogue, raypaged/kernels/gemv_epilogues.py), which then
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


def rope_in_place(query: torch.Tensor, key: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> None:
    """Rotate query [T, Hq, D] and key [T, Hkv, D] (views, last dim contiguous) in place by the
    tables of `rope_tables` ([T, D/2] fp32, contiguous)."""
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
