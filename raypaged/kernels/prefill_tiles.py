"""The paged prefill kernel's tiles: what one BLOCK_N-key tile does, and the loops over them.

paged_prefill.py's kernel holds a program's BLOCK_M queries and calls these: attend_paged for
keys read through the block table, attend_new for the step's own contiguous new K/V (one
new_tile each, by pointers or a TMA descriptor), each running softmax_update, the online-softmax
step. window_keep / window_tiles are the sliding window's mask and tile bounds. MASKED selects
the loop variant with bounds, causal and window masks; the unmasked one loads without checks.
An FP8 pool's tiles are widened as read, and the new tokens quantized as the write kernel stored
them (kv_quant.quantize_fp8_tile), so every key is the same number from either source.
"""

from __future__ import annotations

import triton
import triton.language as tl

from .kv_quant import quantize_fp8_tile
from .triton_common import dot, tanh


@triton.jit
def load_tile(ptrs, mask, MASKED: tl.constexpr):
    if MASKED:
        return tl.load(ptrs, mask=mask, other=0.0)
    else:
        return tl.load(ptrs)


@triton.jit
def window_keep(keep, key_pos, query_pos, window, HAS_WINDOW: tl.constexpr):
    """keep, and the key within the query's sliding window (p - window, p]."""
    if HAS_WINDOW:
        keep = keep & (key_pos[None, :] > query_pos[:, None] - window)
    return keep


@triton.jit
def window_tiles(key_floor, key_full, origin, split, BLOCK_N: tl.constexpr):
    """On a tile grid from `origin`: the first tile holding a key some row sees (key_floor on)
    and the end of the masked edge tiles, where every row sees every key (key_full on) but not
    past `split` (where the unmasked loop ends)."""
    lo = origin + (tl.maximum(key_floor - origin, 0) // BLOCK_N) * BLOCK_N
    full = origin + tl.cdiv(tl.maximum(key_full - origin, 0), BLOCK_N) * BLOCK_N
    edge_end = tl.minimum(full, split)
    return lo, edge_end


@triton.jit
def softmax_update(acc, m_i, l_i, q, k, v, qk_keep, scale_log2, MASKED: tl.constexpr,
                    DOT_MODE: tl.constexpr, softcap_log2, SOFTCAP: tl.constexpr,
                    HAS_WINDOW: tl.constexpr):
    """One online-softmax step over a K/V tile. qk_keep (MASKED only): which scores count.
    SOFTCAP: scale_log2 is scale / cap and softcap_log2 cap · log2(e) (softcap_scales)."""
    qk = dot(q, tl.trans(k), DOT_MODE)
    if SOFTCAP:
        qk = tanh(qk * scale_log2) * softcap_log2
        score_scale = 1.0
    else:
        score_scale = scale_log2
    if MASKED:
        qk = tl.where(qk_keep, qk, float("-inf"))
    # Scaling folded into one FMA per score. Every valid row sees at least one key in its
    # first tile (key 0 or its own position), so m_new is finite from the first tile on.
    m_new = tl.maximum(m_i, tl.max(qk, 1) * score_scale)
    if HAS_WINDOW:
        # Except under a window: a row may see nothing of the edge tile before its own window.
        # Its max stays -inf (a stand-in of 0 would stay the max under later negative scores,
        # costing P's precision and, below 2^-126, all of it); only the exponents use the 0.
        m_exp = tl.where(m_new == float("-inf"), 0.0, m_new)
    else:
        m_exp = m_new
    p = tl.exp2(qk * score_scale - m_exp[:, None])
    alpha = tl.exp2(m_i - m_exp)
    l_i = l_i * alpha + tl.sum(p, 1)
    acc = acc * alpha[:, None] + dot(p.to(v.dtype), v, DOT_MODE)
    return acc, m_new, l_i


@triton.jit
def attend_paged(acc, m_i, l_i, q, k_cache_ptr, v_cache_ptr, table_row, head_offset, query_pos,
                  kv_from, kv_to, scale_log2, stride_cache_block, stride_cache_slot, dims, dim_ok,
                  MASKED: tl.constexpr, EVEN_DIM: tl.constexpr, BLOCK_SIZE: tl.constexpr,
                  BLOCK_N: tl.constexpr, DOT_MODE: tl.constexpr, softcap_log2, window,
                  key_floor, SOFTCAP: tl.constexpr, HAS_WINDOW: tl.constexpr,
                  FP8_KV: tl.constexpr):
    """Keys [kv_from, kv_to) through the block table. MASKED: bounds + causal (+ window)
    masks; under a window keys before key_floor (no row's window) are not loaded either."""
    for tile_start in range(kv_from, kv_to, BLOCK_N):
        key_pos = tile_start + tl.arange(0, BLOCK_N)
        key_ok = key_pos < kv_to
        if HAS_WINDOW:
            key_ok = key_ok & (key_pos >= key_floor)
        # Masked lanes never load: unused slots and table entries may hold anything (NaN).
        blocks = load_tile(table_row + key_pos // BLOCK_SIZE, key_ok, MASKED)
        if HAS_WINDOW and MASKED:
            # A freed entry (-1, a block the sliding group gave back) is never loaded through.
            # Only the window's edge can reach before it; the unmasked tiles are in every
            # row's window, where the manager keeps every block.
            key_ok = key_ok & (blocks >= 0)
        kv_mask = key_ok[:, None] & dim_ok[None, :]
        MASK_KV: tl.constexpr = MASKED or not EVEN_DIM
        slots = (key_pos % BLOCK_SIZE) * stride_cache_slot
        offsets = blocks.to(tl.int64) * stride_cache_block + slots
        kv_ptrs = (offsets + head_offset)[:, None] + dims[None, :]
        k = load_tile(k_cache_ptr + kv_ptrs, kv_mask, MASK_KV)
        v = load_tile(v_cache_ptr + kv_ptrs, kv_mask, MASK_KV)
        if FP8_KV:
            k = k.to(q.dtype)
            v = v.to(q.dtype)
        keep = key_ok[None, :] & (key_pos[None, :] <= query_pos[:, None])
        keep = window_keep(keep, key_pos, query_pos, window, HAS_WINDOW and MASKED)
        acc, m_i, l_i = softmax_update(acc, m_i, l_i, q, k, v, keep, scale_log2, MASKED, DOT_MODE,
                                        softcap_log2, SOFTCAP, HAS_WINDOW)
    return acc, m_i, l_i


@triton.jit
def new_tile(acc, m_i, l_i, q, k_new_ptr, v_new_ptr, k_desc, v_desc, row_base, desc_col,
              query_pos, tile_start, kv_to, scale_log2, stride_new_tok, dims, dim_ok,
              MASKED: tl.constexpr, EVEN_DIM: tl.constexpr, BLOCK_N: tl.constexpr,
              SOURCE: tl.constexpr, DOT_MODE: tl.constexpr, softcap_log2, window,
              key_floor, SOFTCAP: tl.constexpr, HAS_WINDOW: tl.constexpr, k_scale, v_scale,
              FP8_KV: tl.constexpr, FP8_MAX: tl.constexpr, E5M2: tl.constexpr):
    key_pos = tile_start + tl.arange(0, BLOCK_N)
    key_ok = key_pos < kv_to
    if HAS_WINDOW:
        key_ok = key_ok & (key_pos >= key_floor)
    if SOURCE == 2:
        # TMA: one descriptor load per tile. Rows past kv_to belong to the next request (or
        # past T: zeros); their scores are masked, and V is zeroed so 0 * garbage stays 0.
        row = row_base + tile_start
        k = k_desc.load([row, desc_col])
        v = v_desc.load([row, desc_col])
        if MASKED:
            v = tl.where(key_ok[:, None], v, 0.0)
    else:
        rows = (row_base + key_pos).to(tl.int64) * stride_new_tok
        ptrs = rows[:, None] + dims[None, :]
        kv_mask = key_ok[:, None] & dim_ok[None, :]
        MASK_KV: tl.constexpr = MASKED or not EVEN_DIM
        k = load_tile(k_new_ptr + ptrs, kv_mask, MASK_KV)
        v = load_tile(v_new_ptr + ptrs, kv_mask, MASK_KV)
    if FP8_KV:
        # The values the write kernel stored (exact in q's dtype), unscaled as the pool's.
        k = quantize_fp8_tile(k, k_scale, FP8_MAX, E5M2).to(q.dtype)
        v = quantize_fp8_tile(v, v_scale, FP8_MAX, E5M2).to(q.dtype)
    keep = key_ok[None, :] & (key_pos[None, :] <= query_pos[:, None])
    keep = window_keep(keep, key_pos, query_pos, window, HAS_WINDOW and MASKED)
    return softmax_update(acc, m_i, l_i, q, k, v, keep, scale_log2, MASKED, DOT_MODE,
                           softcap_log2, SOFTCAP, HAS_WINDOW)


@triton.jit
def attend_new(acc, m_i, l_i, q, k_new_ptr, v_new_ptr, k_desc, v_desc, row_base, desc_col,
                query_pos, kv_from, kv_to, scale_log2, stride_new_tok, dims, dim_ok,
                MASKED: tl.constexpr, EVEN_DIM: tl.constexpr, BLOCK_N: tl.constexpr,
                SOURCE: tl.constexpr, WARP_SPECIALIZE: tl.constexpr, DOT_MODE: tl.constexpr,
                softcap_log2, window, key_floor, SOFTCAP: tl.constexpr,
                HAS_WINDOW: tl.constexpr, k_scale, v_scale, FP8_KV: tl.constexpr,
                FP8_MAX: tl.constexpr, E5M2: tl.constexpr):
    """Keys [kv_from, kv_to) (sequence positions) from the step's contiguous k/v rows
    row_base + position. WARP_SPECIALIZE asks the compiler to split loads / MMA / softmax
    into warp groups (documented for Blackwell; tried on Hopper by the tune script)."""
    if WARP_SPECIALIZE:
        for tile_start in tl.range(kv_from, kv_to, BLOCK_N, warp_specialize=True):
            acc, m_i, l_i = new_tile(
                acc, m_i, l_i, q, k_new_ptr, v_new_ptr, k_desc, v_desc, row_base, desc_col,
                query_pos, tile_start, kv_to, scale_log2, stride_new_tok, dims, dim_ok,
                MASKED, EVEN_DIM, BLOCK_N, SOURCE, DOT_MODE, softcap_log2, window, key_floor,
                SOFTCAP, HAS_WINDOW, k_scale, v_scale, FP8_KV, FP8_MAX, E5M2)
    else:
        for tile_start in range(kv_from, kv_to, BLOCK_N):
            acc, m_i, l_i = new_tile(
                acc, m_i, l_i, q, k_new_ptr, v_new_ptr, k_desc, v_desc, row_base, desc_col,
                query_pos, tile_start, kv_to, scale_log2, stride_new_tok, dims, dim_ok,
                MASKED, EVEN_DIM, BLOCK_N, SOURCE, DOT_MODE, softcap_log2, window, key_floor,
                SOFTCAP, HAS_WINDOW, k_scale, v_scale, FP8_KV, FP8_MAX, E5M2)
    return acc, m_i, l_i


