"""Triton kernel: store each new token's K and V into its slot of the paged pools.

Rope is not folded in here: one program per token would serialise what a rope kernel spreads
over the heads' programs (tried, no faster: benchmarks/README.md, history); it runs in the qkv
GEMM's epilogue or its own kernel instead (gemv_epilogues.py).

An FP8 pool stores each value quantized with its layer's scale (kv_quant.py): divided, clamped
to the dtype's range (saturating, never inf or NaN), rounded to nearest-even."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .kv_quant import is_fp8, quantize_fp8_tile, round_fp8_args
from .pdl import pdl_launch, wait_for_inputs
from .validation import check_kv_scales, check_write_inputs


@triton.jit
def _write_kv_kernel(
    key_ptr,
    value_ptr,
    k_cache_ptr,
    v_cache_ptr,
    slot_mapping_ptr,
    k_scale_ptr,
    v_scale_ptr,
    stride_key_tok,
    stride_key_head,
    stride_value_tok,
    stride_value_head,
    stride_cache_block,
    stride_cache_slot,
    stride_cache_head,
    num_kv_heads,
    head_dim,
    capacity,
    BLOCK_SIZE: tl.constexpr,
    HEADS_PAD: tl.constexpr,
    DIM_PAD: tl.constexpr,
    USE_PDL: tl.constexpr,
    FP8: tl.constexpr,
    FP8_MAX: tl.constexpr,
    E5M2: tl.constexpr,
):
    wait_for_inputs(USE_PDL)
    token = tl.program_id(0).to(tl.int64)
    slot = tl.load(slot_mapping_ptr + token).to(tl.int64)
    # -1 marks a padding token. Out-of-pool slots are the caller's bug; checking them on the host
    # would cost a sync, so the kernel at least never writes outside the pool.
    if (slot < 0) | (slot >= capacity):
        return
    block = slot // BLOCK_SIZE
    offset = slot % BLOCK_SIZE
    heads = tl.arange(0, HEADS_PAD)[:, None]
    dims = tl.arange(0, DIM_PAD)[None, :]
    mask = (heads < num_kv_heads) & (dims < head_dim)
    # int64 throughout: block * stride overflows int32 on pools past 2^31 elements.
    cache_offsets = block * stride_cache_block + offset * stride_cache_slot + heads * stride_cache_head + dims
    k = tl.load(key_ptr + token * stride_key_tok + heads * stride_key_head + dims, mask=mask)
    v = tl.load(value_ptr + token * stride_value_tok + heads * stride_value_head + dims, mask=mask)
    if FP8:
        k = quantize_fp8_tile(k, tl.load(k_scale_ptr), FP8_MAX, E5M2)
        v = quantize_fp8_tile(v, tl.load(v_scale_ptr), FP8_MAX, E5M2)
    tl.store(k_cache_ptr + cache_offsets, k.to(k_cache_ptr.dtype.element_ty), mask=mask)
    tl.store(v_cache_ptr + cache_offsets, v.to(v_cache_ptr.dtype.element_ty), mask=mask)


def write_kv_triton(
    key: torch.Tensor,
    value: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    k_scale: torch.Tensor | None = None,
    v_scale: torch.Tensor | None = None,
) -> None:
    """Store key/value [T, Hkv, D] at slot_mapping [T]; -1 writes nothing. No host sync.
    An FP8 pool takes its layer's k_scale / v_scale (one fp32 element each) and stores the
    values quantized with them."""
    check_write_inputs(key, value, k_cache, v_cache, slot_mapping)
    check_kv_scales(k_cache, k_scale, v_scale)
    num_tokens, num_kv_heads, head_dim = key.shape
    if num_tokens == 0:
        return
    _write_kv_kernel[(num_tokens,)](
        key,
        value,
        k_cache,
        v_cache,
        slot_mapping,
        k_scale,
        v_scale,
        key.stride(0),
        key.stride(1),
        value.stride(0),
        value.stride(1),
        k_cache.stride(0),
        k_cache.stride(1),
        k_cache.stride(2),
        num_kv_heads,
        head_dim,
        k_cache.shape[0] * k_cache.shape[1],
        BLOCK_SIZE=k_cache.shape[1],
        HEADS_PAD=triton.next_power_of_2(num_kv_heads),
        DIM_PAD=triton.next_power_of_2(head_dim),
        num_warps=4 if num_kv_heads * head_dim >= 1024 else 1,
        FP8=is_fp8(k_cache.dtype),
        **round_fp8_args(k_cache.dtype),
        **pdl_launch(key),
    )
