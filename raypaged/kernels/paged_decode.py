"""Triton paged decode: split-K (FlashDecoding) with GQA packing, plus a log-sum-exp merge.

Stage 1, grid (num_seqs, num_kv_heads, max_splits): one program reads one split of one
sequence's context for one KV head, following the block table tile by tile, and computes all the
query heads that share that KV head at once (one dot of [group, D] x [D, tile]) so each K/V
byte is read once. Each sequence cuts its own context into splits of equal, tile-aligned length;
programs past its last split exit at once. The grid depends only on shapes and the caller's
max_seq_len, never on data, so the launch can be captured in a CUDA graph.

Stage 2, grid (num_seqs, num_q_heads): merges each head's partial outputs by their log-sum-exp.
With one split, stage 1 writes the output directly and stage 2 is skipped.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .pdl import pdl_launch, wait_for_inputs
from .triton_common import LOG2_E, dot, dot_mode, num_sms
from .validation import check_decode_inputs, output_for


# The block table's row stride is the widest table of the step: left unspecialised, so a width
# that happens to be 1 or a multiple of 16 does not compile another variant mid-serving.
@triton.jit(do_not_specialize=["stride_table_seq"])
def _decode_split_kernel(
    q_ptr,
    k_cache_ptr,
    v_cache_ptr,
    block_tables_ptr,
    seq_lens_ptr,
    out_ptr,
    partial_out_ptr,
    partial_lse_ptr,
    scale_log2,
    stride_q_seq,
    stride_q_head,
    stride_cache_block,
    stride_cache_slot,
    stride_cache_head,
    stride_table_seq,
    stride_out_seq,
    stride_out_head,
    GROUP: tl.constexpr,
    GROUP_PAD: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    DIM_PAD: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    TILE_N: tl.constexpr,
    MAX_SPLITS: tl.constexpr,
    DOT_MODE: tl.constexpr,
    USE_PDL: tl.constexpr,
):
    wait_for_inputs(USE_PDL)
    seq = tl.program_id(0).to(tl.int64)
    kv_head = tl.program_id(1)
    split = tl.program_id(2)
    num_q_heads = tl.num_programs(1) * GROUP

    seq_len = tl.load(seq_lens_ptr + seq)
    split_len = tl.cdiv(tl.cdiv(seq_len, MAX_SPLITS), TILE_N) * TILE_N
    start = split * split_len
    if MAX_SPLITS > 1:
        if start >= seq_len:
            return
    end = tl.minimum(start + split_len, seq_len)

    rows = tl.arange(0, GROUP_PAD)
    dims = tl.arange(0, DIM_PAD)
    row_ok = rows < GROUP
    dim_ok = dims < HEAD_DIM
    heads = kv_head * GROUP + rows
    q = tl.load(
        q_ptr + seq * stride_q_seq + heads[:, None] * stride_q_head + dims[None, :],
        mask=row_ok[:, None] & dim_ok[None, :],
        other=0.0,
    )

    m_i = tl.full([GROUP_PAD], float("-inf"), tl.float32)
    l_i = tl.zeros([GROUP_PAD], tl.float32)
    acc = tl.zeros([GROUP_PAD, DIM_PAD], tl.float32)
    table_row = block_tables_ptr + seq * stride_table_seq
    head_offset = kv_head.to(tl.int64) * stride_cache_head
    for tile_start in range(start, end, TILE_N):
        tokens = tile_start + tl.arange(0, TILE_N)
        tok_ok = tokens < end
        # Masked lanes never load: unused slots and table entries may hold anything (NaN).
        blocks = tl.load(table_row + tokens // BLOCK_SIZE, mask=tok_ok, other=0).to(tl.int64)
        offsets = blocks * stride_cache_block + (tokens % BLOCK_SIZE) * stride_cache_slot + head_offset
        kv_mask = tok_ok[:, None] & dim_ok[None, :]
        k = tl.load(k_cache_ptr + offsets[:, None] + dims[None, :], mask=kv_mask, other=0.0)
        scores = dot(q, tl.trans(k), DOT_MODE) * scale_log2
        scores = tl.where(tok_ok[None, :], scores, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(scores, 1))
        alpha = tl.exp2(m_i - m_new)
        p = tl.exp2(scores - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)
        v = tl.load(v_cache_ptr + offsets[:, None] + dims[None, :], mask=kv_mask, other=0.0)
        acc = acc * alpha[:, None] + dot(p.to(v.dtype), v, DOT_MODE)
        m_i = m_new

    # l_i == 0 only for an empty (seq_len 0) sequence: its output is zeros.
    result = acc / tl.where(l_i > 0, l_i, 1.0)[:, None]
    out_mask = row_ok[:, None] & dim_ok[None, :]
    if MAX_SPLITS == 1:
        out_offsets = seq * stride_out_seq + heads[:, None] * stride_out_head + dims[None, :]
        tl.store(out_ptr + out_offsets, result.to(out_ptr.dtype.element_ty), mask=out_mask)
    else:
        # partial_out [S, Hq, MAX_SPLITS, DIM_PAD] fp32, partial_lse [S, Hq, MAX_SPLITS] (log2).
        lse_index = (seq * num_q_heads + heads) * MAX_SPLITS + split
        tl.store(partial_out_ptr + lse_index[:, None] * DIM_PAD + dims[None, :], result, mask=out_mask)
        tl.store(partial_lse_ptr + lse_index, m_i + tl.log2(l_i), mask=row_ok)


@triton.jit
def _decode_merge_kernel(
    seq_lens_ptr,
    partial_out_ptr,
    partial_lse_ptr,
    out_ptr,
    stride_out_seq,
    stride_out_head,
    HEAD_DIM: tl.constexpr,
    DIM_PAD: tl.constexpr,
    TILE_N: tl.constexpr,
    MAX_SPLITS: tl.constexpr,
    USE_PDL: tl.constexpr,
):
    wait_for_inputs(USE_PDL)
    seq = tl.program_id(0).to(tl.int64)
    head = tl.program_id(1)
    num_q_heads = tl.num_programs(1)
    seq_len = tl.load(seq_lens_ptr + seq)
    # The same split arithmetic as stage 1: splits past the last never wrote anything.
    split_len = tl.cdiv(tl.cdiv(seq_len, MAX_SPLITS), TILE_N) * TILE_N
    num_active = tl.cdiv(seq_len, tl.maximum(split_len, 1))

    splits = tl.arange(0, MAX_SPLITS)
    dims = tl.arange(0, DIM_PAD)
    active = splits < num_active
    base = (seq * num_q_heads + head) * MAX_SPLITS
    lse = tl.load(partial_lse_ptr + base + splits, mask=active, other=float("-inf"))
    lse_max = tl.max(lse, 0)
    weights = tl.where(active, tl.exp2(lse - lse_max), 0.0)
    partial = tl.load(
        partial_out_ptr + (base + splits)[:, None] * DIM_PAD + dims[None, :],
        mask=active[:, None],
        other=0.0,
    )
    total = tl.sum(weights, 0)
    result = tl.sum(partial * weights[:, None], 0) / tl.where(total > 0, total, 1.0)
    tl.store(
        out_ptr + seq * stride_out_seq + head * stride_out_head + dims,
        result.to(out_ptr.dtype.element_ty),
        mask=dims < HEAD_DIM,
    )


# Each split should stream at least this many tokens, or the merge costs more than it saves. On the
# H200 one sequence of 1,024 tokens took less time in 8 splits than in 4 (bench_kernels.py
# --tune decode): at short contexts the latency of a split's serial tiles, not the merge, is
# what costs.
MIN_TOKENS_PER_SPLIT = 128
MAX_NUM_SPLITS = 64
# Programs per multiprocessor to aim for, so memory latency is hidden by many loads in flight.
TARGET_PROGRAMS_PER_SM = 4


def choose_num_splits(num_seqs: int, num_kv_heads: int, max_seq_len: int, sm_count: int) -> int:
    """Splits per sequence: enough programs to fill the card, no split shorter than the minimum.

    The largest power of two not above the target (few kernel variants get compiled; on the
    H200 rounding down measured 2-4% faster than rounding up at (8, 8192) and (64, 4096)).
    Host ints only (no device reads).
    """
    programs = max(num_seqs * num_kv_heads, 1)
    wanted = TARGET_PROGRAMS_PER_SM * sm_count // programs
    by_length = max_seq_len // MIN_TOKENS_PER_SPLIT
    splits = max(min(wanted, by_length, MAX_NUM_SPLITS), 1)
    return 1 << (splits.bit_length() - 1)


def default_launch_config(head_dim: int, dtype: torch.dtype) -> dict:
    """Tile, warps and stages for the split kernel.

    From the H200 sweep (benchmarks/bench_kernels.py --tune decode, 18 configs x 4 shapes):
    64-token tiles with 4 warps were best at every shape; 128-token tiles lost 2-10%, 32-token
    tiles 5-21%, 8 warps 4-33%. Stages 3 vs 4 were within noise.
    """
    return {"tile_n": 64, "num_warps": 4, "num_stages": 3}


def paged_decode_triton(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float,
    out: torch.Tensor | None = None,
    *,
    max_seq_len: int | None = None,
    num_splits: int | None = None,
    tile_n: int | None = None,
    num_warps: int | None = None,
    num_stages: int | None = None,
) -> torch.Tensor:
    """Paged decode, q [S, Hq, D] -> [S, Hq, D]. No host synchronisation.

    max_seq_len bounds seq_lens (default: the block table's capacity) and, with the SM count,
    sets the split count; num_splits / tile_n / num_warps / num_stages override the tuned
    defaults (benchmarks and tests).
    """
    check_decode_inputs(q, k_cache, v_cache, block_tables, seq_lens)
    num_seqs, num_q_heads, head_dim = q.shape
    _, block_size, num_kv_heads, _ = k_cache.shape
    out = output_for(q, out)
    if num_seqs == 0:
        return out
    if max_seq_len is None:
        max_seq_len = block_tables.shape[1] * block_size
    if num_splits is None:
        num_splits = choose_num_splits(num_seqs, num_kv_heads, max_seq_len, num_sms(q.device))
    if num_splits < 1 or num_splits & (num_splits - 1):
        raise ValueError(f"num_splits must be a power of two >= 1, got {num_splits}")
    config = default_launch_config(head_dim, q.dtype)
    tile_n = tile_n or config["tile_n"]
    group = num_q_heads // num_kv_heads
    dim_pad = triton.next_power_of_2(head_dim)
    if num_splits > 1:
        partial_out = torch.empty(
            (num_seqs, num_q_heads, num_splits, dim_pad), dtype=torch.float32, device=q.device
        )
        partial_lse = torch.empty(
            (num_seqs, num_q_heads, num_splits), dtype=torch.float32, device=q.device
        )
    else:  # unused by the kernel on the direct path
        partial_out = partial_lse = out
    _decode_split_kernel[(num_seqs, num_kv_heads, num_splits)](
        q,
        k_cache,
        v_cache,
        block_tables,
        seq_lens,
        out,
        partial_out,
        partial_lse,
        scale * LOG2_E,
        q.stride(0),
        q.stride(1),
        k_cache.stride(0),
        k_cache.stride(1),
        k_cache.stride(2),
        block_tables.stride(0),
        out.stride(0),
        out.stride(1),
        GROUP=group,
        # tl.dot needs at least 16 rows; padded query rows are masked on load and store.
        GROUP_PAD=max(16, triton.next_power_of_2(group)),
        HEAD_DIM=head_dim,
        DIM_PAD=dim_pad,
        BLOCK_SIZE=block_size,
        TILE_N=tile_n,
        MAX_SPLITS=num_splits,
        DOT_MODE=dot_mode(q),
        num_warps=num_warps or config["num_warps"],
        num_stages=num_stages or config["num_stages"],
        **pdl_launch(q),
    )
    if num_splits > 1:
        _decode_merge_kernel[(num_seqs, num_q_heads)](
            seq_lens,
            partial_out,
            partial_lse,
            out,
            out.stride(0),
            out.stride(1),
            HEAD_DIM=head_dim,
            DIM_PAD=dim_pad,
            TILE_N=tile_n,
            MAX_SPLITS=num_splits,
            num_warps=4 if dim_pad * num_splits >= 2048 else 2,
            **pdl_launch(q),
        )
    return out
