"""Triton paged prefill / extend: varlen causal attention over a cached prefix and new tokens.

One kernel serves first prefill, chunked prefill and prefix-cache hits: request s has
seq_lens[s] positions in the cache, the last q_len_s of which are its new tokens (already
written). Flash-attention style: a program owns BLOCK_M new tokens of one request and one query
head, and streams that request's K/V in BLOCK_N-token tiles through the block table with an
online softmax. Tiles wholly before the program's first query need no causal mask and run in a
separate loop; only the diagonal tiles pay for masking.

The grid is (num_q_heads, num_tokens // BLOCK_M + num_seqs): the second is an upper bound on the query tiles
of any varlen batch of that many tokens and requests, so it depends on shapes only. Request s
owns tile indices from query_start_loc[s] // BLOCK_M + s on; each program finds its request by
binary search and exits if its tile is past the request's tokens.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .triton_common import LOG2_E, dot, dot_mode
from .validation import check_prefill_inputs, output_for


@triton.jit
def _load_tile(ptrs, mask, MASKED: tl.constexpr):
    if MASKED:
        return tl.load(ptrs, mask=mask, other=0)
    else:
        return tl.load(ptrs)


@triton.jit
def _attend_tiles(
    acc,
    m_i,
    l_i,
    q,
    k_cache_ptr,
    v_cache_ptr,
    table_row,
    head_offset,
    query_pos,
    kv_from,
    kv_to,
    scale_log2,
    stride_cache_block,
    stride_cache_slot,
    dims,
    dim_ok,
    CAUSAL: tl.constexpr,
    EVEN_DIM: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    BLOCK_N: tl.constexpr,
    DOT_MODE: tl.constexpr,
):
    """Online-softmax update over key positions [kv_from, kv_to).

    CAUSAL=False is the hot loop over whole tiles that every query sees: no masks at all.
    CAUSAL=True handles the diagonal: keys past kv_to or after a row's own position are masked.
    """
    for tile_start in range(kv_from, kv_to, BLOCK_N):
        key_pos = tile_start + tl.arange(0, BLOCK_N)
        key_ok = key_pos < kv_to
        # Masked lanes never load: unused slots and table entries may hold anything (NaN).
        blocks = _load_tile(table_row + key_pos // BLOCK_SIZE, key_ok, CAUSAL)
        kv_mask = key_ok[:, None] & dim_ok[None, :]
        MASK_KV: tl.constexpr = CAUSAL or not EVEN_DIM
        offsets = blocks.to(tl.int64) * stride_cache_block + (key_pos % BLOCK_SIZE) * stride_cache_slot
        kv_ptrs = (offsets + head_offset)[:, None] + dims[None, :]
        k = _load_tile(k_cache_ptr + kv_ptrs, kv_mask, MASK_KV)
        qk = dot(q, tl.trans(k), DOT_MODE)
        if CAUSAL:
            visible = key_ok[None, :] & (key_pos[None, :] <= query_pos[:, None])
            qk = tl.where(visible, qk, float("-inf"))
        # Scaling folded into one FMA per score. Every row sees key 0 or its own position in its
        # first tile, so m_new is finite from the first tile on.
        m_new = tl.maximum(m_i, tl.max(qk, 1) * scale_log2)
        p = tl.exp2(qk * scale_log2 - m_new[:, None])
        alpha = tl.exp2(m_i - m_new)
        l_i = l_i * alpha + tl.sum(p, 1)
        v = _load_tile(v_cache_ptr + kv_ptrs, kv_mask, MASK_KV)
        acc = acc * alpha[:, None] + dot(p.to(v.dtype), v, DOT_MODE)
        m_i = m_new
    return acc, m_i, l_i


@triton.jit
def _prefill_kernel(
    q_ptr,
    k_cache_ptr,
    v_cache_ptr,
    block_tables_ptr,
    query_start_loc_ptr,
    seq_lens_ptr,
    out_ptr,
    scale_log2,
    num_seqs,
    stride_q_tok,
    stride_q_head,
    stride_cache_block,
    stride_cache_slot,
    stride_cache_head,
    stride_table_seq,
    stride_out_tok,
    stride_out_head,
    GROUP: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    DIM_PAD: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    HEADS_PER_PROGRAM: tl.constexpr,
    DOT_MODE: tl.constexpr,
):
    # A program owns BLOCK_M rows = TILE_TOKENS new tokens x HEADS_PER_PROGRAM query heads of
    # one KV head (row r: token r // HEADS_PER_PROGRAM, head r % HEADS_PER_PROGRAM), so with
    # HEADS_PER_PROGRAM = GROUP each K/V tile is loaded once for the whole GQA group.
    TILE_TOKENS: tl.constexpr = BLOCK_M // HEADS_PER_PROGRAM
    # Heads vary fastest and tiles run latest-first: under causality the latest tiles stream
    # the most keys, so the heaviest work starts first and the tail is short.
    first_head = tl.program_id(0) * HEADS_PER_PROGRAM
    tile = tl.num_programs(1) - 1 - tl.program_id(1)

    # Largest s with query_start_loc[s] // TILE_TOKENS + s <= tile.
    lo = tl.full([], 0, tl.int32)
    hi = tl.full([], 0, tl.int32) + num_seqs
    while lo + 1 < hi:
        mid = (lo + hi) // 2
        mid_first_tile = tl.load(query_start_loc_ptr + mid) // TILE_TOKENS + mid
        lo = tl.where(mid_first_tile <= tile, mid, lo)
        hi = tl.where(mid_first_tile <= tile, hi, mid)
    seq = lo
    q_start = tl.load(query_start_loc_ptr + seq)
    q_len = tl.load(query_start_loc_ptr + seq + 1) - q_start
    m_start = (tile - (q_start // TILE_TOKENS + seq)) * TILE_TOKENS
    if m_start >= q_len:
        return
    seq_len = tl.load(seq_lens_ptr + seq)
    prefix_len = seq_len - q_len

    rows = tl.arange(0, BLOCK_M)
    local_tokens = m_start + rows // HEADS_PER_PROGRAM
    heads = first_head + rows % HEADS_PER_PROGRAM
    row_ok = local_tokens < q_len
    dims = tl.arange(0, DIM_PAD)
    dim_ok = dims < HEAD_DIM
    tokens = (q_start + local_tokens).to(tl.int64)
    q_mask = row_ok[:, None] & dim_ok[None, :]
    q = tl.load(
        q_ptr + (tokens * stride_q_tok + heads * stride_q_head)[:, None] + dims[None, :],
        mask=q_mask,
        other=0.0,
    )
    query_pos = prefix_len + local_tokens

    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, DIM_PAD], tl.float32)
    table_row = block_tables_ptr + seq.to(tl.int64) * stride_table_seq
    head_offset = (first_head // GROUP).to(tl.int64) * stride_cache_head
    # Every key before the tile's first query is visible to all its rows.
    unmasked_end = ((prefix_len + m_start) // BLOCK_N) * BLOCK_N
    kv_end = prefix_len + tl.minimum(m_start + TILE_TOKENS, q_len)
    acc, m_i, l_i = _attend_tiles(
        acc, m_i, l_i, q, k_cache_ptr, v_cache_ptr, table_row, head_offset, query_pos,
        0, unmasked_end, scale_log2, stride_cache_block, stride_cache_slot, dims, dim_ok,
        CAUSAL=False, EVEN_DIM=HEAD_DIM == DIM_PAD, BLOCK_SIZE=BLOCK_SIZE, BLOCK_N=BLOCK_N, DOT_MODE=DOT_MODE,
    )
    acc, m_i, l_i = _attend_tiles(
        acc, m_i, l_i, q, k_cache_ptr, v_cache_ptr, table_row, head_offset, query_pos,
        unmasked_end, kv_end, scale_log2, stride_cache_block, stride_cache_slot, dims, dim_ok,
        CAUSAL=True, EVEN_DIM=HEAD_DIM == DIM_PAD, BLOCK_SIZE=BLOCK_SIZE, BLOCK_N=BLOCK_N, DOT_MODE=DOT_MODE,
    )

    result = acc / tl.where(l_i > 0, l_i, 1.0)[:, None]
    tl.store(
        out_ptr + (tokens * stride_out_tok + heads * stride_out_head)[:, None] + dims[None, :],
        result.to(out_ptr.dtype.element_ty),
        mask=q_mask,
    )


def default_launch_config(head_dim: int, dtype: torch.dtype, device: torch.device) -> dict:
    """Tile sizes, warps, stages and GQA packing.

    H200, bf16, d 128 (benchmarks/results/kernels_h200_tune_prefill.json): 128x128 tiles with
    8 warps and 3 stages were best of 14 at 4k and 8k tokens (363 / 392 TFLOP/s; 128x64 with
    8 warps: 316 / 328). Packing the GQA group into one program changed nothing beyond noise
    (+-1%), so it stays off. The CPU interpreter pays per program and per loop step, not per
    element: big tiles there.
    """
    if device.type != "cuda":
        return {"block_m": 64, "block_n": 64, "num_warps": 4, "num_stages": 1, "pack_gqa": False}
    if dtype == torch.float32:
        return {"block_m": 32, "block_n": 32, "num_warps": 4, "num_stages": 2, "pack_gqa": False}
    return {"block_m": 128, "block_n": 128, "num_warps": 8, "num_stages": 3, "pack_gqa": False}


def paged_prefill_triton(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    query_start_loc: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float,
    out: torch.Tensor | None = None,
    *,
    block_m: int | None = None,
    block_n: int | None = None,
    num_warps: int | None = None,
    num_stages: int | None = None,
    pack_gqa: bool | None = None,
) -> torch.Tensor:
    """Varlen causal paged attention, q [T, Hq, D] -> [T, Hq, D]. No host synchronisation.

    block_m / block_n / num_warps / num_stages / pack_gqa (one program per GQA group rather
    than per query head) override the tuned defaults (benchmarks, tests).
    """
    check_prefill_inputs(q, k_cache, v_cache, block_tables, query_start_loc, seq_lens)
    num_tokens, num_q_heads, head_dim = q.shape
    _, block_size, num_kv_heads, _ = k_cache.shape
    out = output_for(q, out)
    num_seqs = seq_lens.shape[0]
    if num_tokens == 0 or num_seqs == 0:
        return out
    config = default_launch_config(head_dim, q.dtype, q.device)
    block_m = block_m or config["block_m"]
    block_n = block_n or config["block_n"]
    group = num_q_heads // num_kv_heads
    pack_gqa = config["pack_gqa"] if pack_gqa is None else pack_gqa
    heads_per_program = group if pack_gqa and block_m % group == 0 else 1
    grid = (num_q_heads // heads_per_program, num_tokens // (block_m // heads_per_program) + num_seqs)
    _prefill_kernel[grid](
        q,
        k_cache,
        v_cache,
        block_tables,
        query_start_loc,
        seq_lens,
        out,
        scale * LOG2_E,
        num_seqs,
        q.stride(0),
        q.stride(1),
        k_cache.stride(0),
        k_cache.stride(1),
        k_cache.stride(2),
        block_tables.stride(0),
        out.stride(0),
        out.stride(1),
        GROUP=group,
        HEAD_DIM=head_dim,
        DIM_PAD=triton.next_power_of_2(head_dim),
        BLOCK_SIZE=block_size,
        BLOCK_M=block_m,
        BLOCK_N=block_n,
        HEADS_PER_PROGRAM=heads_per_program,
        DOT_MODE=dot_mode(q),
        num_warps=num_warps or config["num_warps"],
        num_stages=num_stages or config["num_stages"],
    )
    return out
