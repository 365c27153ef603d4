"""Triton kernel: store each new token's K and V into its slot of the paged pools, optionally
rotating q and k by rope first (one kernel where a decode step had two: at batch 1 on the H200
rope and the KV write were 0.06 + 0.04 ms of a 4.3 ms 8B step, 64 launches)."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .pdl import pdl_launch, wait_for_inputs
from .validation import check_rope_inputs, check_write_inputs


@triton.jit
def _rotate_halves(base, heads, halves, mask, cos, sin, stride_head, HALF: tl.constexpr):
    """The rotated first and second halves of the heads at `base` ("rotate half" layout: dims i
    and i + D/2 form one pair), in their own dtype, as the rope kernel computes them."""
    x1 = tl.load(base + heads * stride_head + halves, mask=mask)
    x2 = tl.load(base + heads * stride_head + HALF + halves, mask=mask)
    a, b = x1.to(tl.float32), x2.to(tl.float32)
    return (a * cos - b * sin).to(x1.dtype), (b * cos + a * sin).to(x1.dtype)


@triton.jit
def _write_kv_kernel(
    key_ptr,
    value_ptr,
    k_cache_ptr,
    v_cache_ptr,
    slot_mapping_ptr,
    query_ptr,  # rope only, like the three below
    positions_ptr,
    inv_freq_ptr,
    stride_key_tok,
    stride_key_head,
    stride_value_tok,
    stride_value_head,
    stride_query_tok,
    stride_query_head,
    stride_cache_block,
    stride_cache_slot,
    stride_cache_head,
    num_kv_heads,
    num_q_heads,
    head_dim,
    capacity,
    BLOCK_SIZE: tl.constexpr,
    HEADS_PAD: tl.constexpr,
    Q_HEADS_PAD: tl.constexpr,
    DIM_PAD: tl.constexpr,
    HALF: tl.constexpr,
    HALF_PAD: tl.constexpr,
    ROPE: tl.constexpr,
    USE_PDL: tl.constexpr,
):
    wait_for_inputs(USE_PDL)
    token = tl.program_id(0).to(tl.int64)
    heads = tl.arange(0, HEADS_PAD)[:, None]
    key_base = key_ptr + token * stride_key_tok
    if ROPE:
        # Every token is rotated, stored or not: a query with no slot may still be attended with.
        halves = tl.arange(0, HALF_PAD)[None, :]
        angle = tl.load(positions_ptr + token).to(tl.float32) * tl.load(
            inv_freq_ptr + halves, mask=halves < HALF)
        cos, sin = tl.cos(angle), tl.sin(angle)
        q_heads = tl.arange(0, Q_HEADS_PAD)[:, None]
        q_mask = (q_heads < num_q_heads) & (halves < HALF)
        query_base = query_ptr + token * stride_query_tok
        q1, q2 = _rotate_halves(query_base, q_heads, halves, q_mask, cos, sin, stride_query_head, HALF)
        tl.store(query_base + q_heads * stride_query_head + halves, q1, mask=q_mask)
        tl.store(query_base + q_heads * stride_query_head + HALF + halves, q2, mask=q_mask)
        k_mask = (heads < num_kv_heads) & (halves < HALF)
        k1, k2 = _rotate_halves(key_base, heads, halves, k_mask, cos, sin, stride_key_head, HALF)
        # Back into the step's key too: prefill reads the new tokens' K from there.
        tl.store(key_base + heads * stride_key_head + halves, k1, mask=k_mask)
        tl.store(key_base + heads * stride_key_head + HALF + halves, k2, mask=k_mask)
    slot = tl.load(slot_mapping_ptr + token).to(tl.int64)
    # -1 marks a padding token. Out-of-pool slots are the caller's bug; checking them on the host
    # would cost a sync, so the kernel at least never writes outside the pool.
    if (slot < 0) | (slot >= capacity):
        return
    block = slot // BLOCK_SIZE
    offset = slot % BLOCK_SIZE
    # int64 throughout: block * stride overflows int32 on pools past 2^31 elements.
    cache_base = block * stride_cache_block + offset * stride_cache_slot + heads * stride_cache_head
    dims = tl.arange(0, DIM_PAD)[None, :]
    mask = (heads < num_kv_heads) & (dims < head_dim)
    if ROPE:
        k_cache = k_cache_ptr + cache_base + halves
        tl.store(k_cache, k1.to(k_cache_ptr.dtype.element_ty), mask=k_mask)
        tl.store(k_cache + HALF, k2.to(k_cache_ptr.dtype.element_ty), mask=k_mask)
    else:
        k = tl.load(key_base + heads * stride_key_head + dims, mask=mask)
        tl.store(k_cache_ptr + cache_base + dims, k.to(k_cache_ptr.dtype.element_ty), mask=mask)
    v = tl.load(value_ptr + token * stride_value_tok + heads * stride_value_head + dims, mask=mask)
    tl.store(v_cache_ptr + cache_base + dims, v.to(v_cache_ptr.dtype.element_ty), mask=mask)


def write_kv_triton(
    key: torch.Tensor,
    value: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    *,
    rope: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None,
) -> None:
    """Store key/value [T, Hkv, D] at slot_mapping [T]; -1 writes nothing. No host sync.

    rope = (query [T, Hq, D], positions [T], inv_freq [D/2] fp32): first rotate query and key in
    place ("rotate half" layout, fp32 angles, as `model.fused.rope_in_place`), and store the
    rotated K."""
    check_write_inputs(key, value, k_cache, v_cache, slot_mapping)
    num_tokens, num_kv_heads, head_dim = key.shape
    if num_tokens == 0:
        return
    query, positions, inv_freq = rope if rope is not None else (key, slot_mapping, key)
    if rope is not None:
        check_rope_inputs(query, key, positions, inv_freq)
    num_q_heads = query.shape[1]
    half = head_dim // 2
    _write_kv_kernel[(num_tokens,)](
        key,
        value,
        k_cache,
        v_cache,
        slot_mapping,
        query,
        positions,
        inv_freq,
        key.stride(0),
        key.stride(1),
        value.stride(0),
        value.stride(1),
        query.stride(0),
        query.stride(1),
        k_cache.stride(0),
        k_cache.stride(1),
        k_cache.stride(2),
        num_kv_heads,
        num_q_heads,
        head_dim,
        k_cache.shape[0] * k_cache.shape[1],
        BLOCK_SIZE=k_cache.shape[1],
        HEADS_PAD=triton.next_power_of_2(num_kv_heads),
        Q_HEADS_PAD=triton.next_power_of_2(num_q_heads),
        DIM_PAD=triton.next_power_of_2(head_dim),
        HALF=half,
        HALF_PAD=triton.next_power_of_2(max(half, 1)),
        ROPE=rope is not None,
        num_warps=4 if (num_q_heads if rope is not None else num_kv_heads) * head_dim >= 1024 else 1,
        **pdl_launch(key),
    )
