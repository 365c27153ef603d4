"""Triton paged decode: one query per sequence over a work list of equal-sized items, GQA packed.

decode_work.py cuts the batch's KV into items of about equal size (a long sequence into many, a
short one whole) and lists them once per step on the device, largest first. Stage 1, grid
(num_kv_heads, items bound): program (h, i) reads item i's token range of its sequence for KV head h, following
the block table tile by tile, and computes all the query heads that share h at once (one dot of
[group, D] x [D, tile]) so each K/V byte is read once. An item that is its sequence's only one
writes the output; the others store a normalised partial output and its log-sum-exp. Stage 2,
grid (split-sequence bound, num_q_heads): each split sequence's head merges its items' partials
by their log-sum-exp, all items in one load; entries past the batch's split sequences exit at
once. Both grids depend on shapes only, so one CUDA graph per batch size serves any mix of
lengths, and nothing is read on the host.

A sliding window needs nothing here: its work list (planned with the window) starts each
sequence's items at the window's first key. A table entry of -1 (a block a sliding KV-cache
group gave back) is never loaded through: its keys count as absent. Soft-capping (SOFTCAP) maps each score s to
c · tanh(s / c) before the softmax.

An FP8 pool (FP8_KV, kernels/kv_quant.py) is widened to the queries' dtype as it is read; its
layer's K scale multiplies the softmax scale and its V scale the output.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .decode_work import (
    ITEM_COUNT,
    ITEM_END,
    ITEM_SEQ,
    ITEM_START,
    MERGES,
    SEQ_COUNT,
    SEQ_FIRST,
    WORK_FIELDS,
    max_merges,
    plan_decode_work,
)
from .kv_quant import is_fp8
from .pdl import pdl_launch, wait_for_inputs
from .triton_common import dot, dot_mode, num_sms, softcap_scales, tanh
from .validation import check_decode_inputs, check_kv_scales, check_window_and_softcap, output_for


# The block table's row stride is the widest table of the step: left unspecialised, so a width
# that happens to be 1 or a multiple of 16 does not compile another variant mid-serving.
@triton.jit(do_not_specialize=["stride_table_seq"])
def _decode_kernel(
    q_ptr,
    k_cache_ptr,
    v_cache_ptr,
    block_tables_ptr,
    item_seq_ptr,
    item_start_ptr,
    item_end_ptr,
    item_count_ptr,
    out_ptr,
    partial_out_ptr,
    partial_lse_ptr,
    k_scale_ptr,
    v_scale_ptr,
    scale_log2,
    softcap_log2,
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
    DOT_MODE: tl.constexpr,
    USE_PDL: tl.constexpr,
    SOFTCAP: tl.constexpr,
    FP8_KV: tl.constexpr,
):
    # SOFTCAP: scale_log2 is scale / cap and softcap_log2 is cap · log2(e) (softcap_scales).
    wait_for_inputs(USE_PDL)
    if FP8_KV:
        scale_log2 = scale_log2 * tl.load(k_scale_ptr)
    # Heads innermost: the GPU starts programs in grid order, and the list's is largest first.
    kv_head = tl.program_id(0)
    item = tl.program_id(1)
    num_q_heads = tl.num_programs(0) * GROUP
    seq = tl.load(item_seq_ptr + item)
    if seq < 0:  # past the batch's last item
        return
    seq = seq.to(tl.int64)
    start = tl.load(item_start_ptr + item)
    end = tl.load(item_end_ptr + item)
    count = tl.load(item_count_ptr + item)

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
        # A freed table entry (-1: a sliding KV-cache group's block given back) is never
        # loaded through; the work list never reaches one, except a CUDA graph's padding row.
        tok_ok = tok_ok & (blocks >= 0)
        offsets = blocks * stride_cache_block + (tokens % BLOCK_SIZE) * stride_cache_slot + head_offset
        kv_mask = tok_ok[:, None] & dim_ok[None, :]
        k = tl.load(k_cache_ptr + offsets[:, None] + dims[None, :], mask=kv_mask, other=0.0)
        if FP8_KV:
            k = k.to(q.dtype)
        scores = dot(q, tl.trans(k), DOT_MODE) * scale_log2
        if SOFTCAP:
            scores = tanh(scores) * softcap_log2
        scores = tl.where(tok_ok[None, :], scores, float("-inf"))
        # Floored: a tile with no key to read for a row (all freed) leaves it at zero, not NaN.
        m_new = tl.maximum(tl.maximum(m_i, tl.max(scores, 1)), -1e30)
        alpha = tl.exp2(m_i - m_new)
        p = tl.exp2(scores - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)
        v = tl.load(v_cache_ptr + offsets[:, None] + dims[None, :], mask=kv_mask, other=0.0)
        if FP8_KV:
            v = v.to(q.dtype)
        acc = acc * alpha[:, None] + dot(p.to(v.dtype), v, DOT_MODE)
        m_i = m_new

    # l_i == 0 only for an empty (seq_len 0) sequence: its output is zeros.
    result = acc / tl.where(l_i > 0, l_i, 1.0)[:, None]
    if FP8_KV:
        result = result * tl.load(v_scale_ptr)
    out_mask = row_ok[:, None] & dim_ok[None, :]
    if count == 1:
        out_offsets = seq * stride_out_seq + heads[:, None] * stride_out_head + dims[None, :]
        tl.store(out_ptr + out_offsets, result.to(out_ptr.dtype.element_ty), mask=out_mask)
    else:
        # partial_out [items bound, Hq, DIM_PAD] fp32, partial_lse [items bound, Hq] (log2).
        lse_index = item.to(tl.int64) * num_q_heads + heads
        tl.store(partial_out_ptr + lse_index[:, None] * DIM_PAD + dims[None, :], result, mask=out_mask)
        tl.store(partial_lse_ptr + lse_index, m_i + tl.log2(l_i), mask=row_ok)


@triton.jit
def _merge_kernel(
    merges_ptr,
    seq_first_ptr,
    seq_count_ptr,
    partial_out_ptr,
    partial_lse_ptr,
    out_ptr,
    stride_out_seq,
    stride_out_head,
    HEAD_DIM: tl.constexpr,
    DIM_PAD: tl.constexpr,
    MERGE_BLOCK: tl.constexpr,
    USE_PDL: tl.constexpr,
):
    wait_for_inputs(USE_PDL)
    seq = tl.load(merges_ptr + tl.program_id(0))
    if seq < 0:  # past the batch's last split sequence
        return
    head = tl.program_id(1)
    num_q_heads = tl.num_programs(1)
    first = tl.load(seq_first_ptr + seq)
    count = tl.load(seq_count_ptr + seq)
    dims = tl.arange(0, DIM_PAD)
    m = tl.full([1], float("-inf"), tl.float32)
    total = tl.zeros([1], tl.float32)
    acc = tl.zeros([DIM_PAD], tl.float32)
    # One pass for up to MERGE_BLOCK items (every batch the default plan makes); more loop.
    for block in range(0, count, MERGE_BLOCK):
        items = block + tl.arange(0, MERGE_BLOCK)
        valid = items < count
        index = (first + items).to(tl.int64) * num_q_heads + head
        lse = tl.load(partial_lse_ptr + index, mask=valid, other=float("-inf"))
        partial = tl.load(partial_out_ptr + index[:, None] * DIM_PAD + dims[None, :],
                          mask=valid[:, None], other=0.0)
        m_new = tl.maximum(m, tl.max(lse, 0))
        alpha = tl.exp2(m - m_new)
        weights = tl.exp2(lse - m_new)
        total = total * alpha + tl.sum(weights, 0)
        acc = acc * alpha + tl.sum(partial * weights[:, None], 0)
        m = m_new
    tl.store(out_ptr + seq.to(tl.int64) * stride_out_seq + head * stride_out_head + dims,
             (acc / total).to(out_ptr.dtype.element_ty), mask=dims < HEAD_DIM)


# Each item should stream at least this many tokens (one tile), or the merge costs more than it
# saves. At short contexts the latency of an item's serial tiles, not the merge, is what costs:
# on the H200 one sequence of 1,024 tokens took less time in 8 splits than in 4, and 16 of 64
# tokens was the split kernel's choice before the work list (benchmarks/README.md).
MIN_TOKENS_PER_ITEM = 64
# Programs per multiprocessor to aim for, so memory latency is hidden by many loads in flight.
TARGET_PROGRAMS_PER_SM = 4
# Items a merge program reads in one load: the default plan never gives a sequence more than
# target_items + 1 (66 + 1 on the H200 at 8 KV heads).
MERGE_BLOCK = 64


def default_target_items(num_kv_heads: int, sm_count: int) -> int:
    """Items per KV head the plan aims for: TARGET_PROGRAMS_PER_SM programs on every SM."""
    return max(TARGET_PROGRAMS_PER_SM * sm_count // num_kv_heads, 1)


def plan_work(seq_lens: torch.Tensor, num_kv_heads: int, *, target_items: int | None = None,
              min_chunk_tokens: int = MIN_TOKENS_PER_ITEM, align: int | None = None,
              out: torch.Tensor | None = None, sliding_window: int | None = None) -> torch.Tensor:
    """The step's decode work list (decode_work.py) with this kernel's defaults: computed once a
    step and passed to every layer's `paged_decode_triton` (with a sliding window: every layer
    of that window)."""
    if target_items is None:
        target_items = default_target_items(num_kv_heads, num_sms(seq_lens.device))
    align = align or default_launch_config(128, torch.bfloat16)["tile_n"]
    return plan_decode_work(seq_lens, target_items, min_chunk_tokens, align, out=out,
                            sliding_window=sliding_window)


def default_launch_config(head_dim: int, dtype: torch.dtype) -> dict:
    """Tile, warps and stages for the decode kernel: a tile of K holds about 16 KB.

    From the H200 sweeps (benchmarks/bench_kernels.py --tune decode): at head dim 128, 64-token
    tiles with 4 warps were best at every shape (128-token tiles lost 2-10%, 32-token tiles
    5-21%, 8 warps 4-33%; stages 3 vs 4 within noise); at head dim 64, 128-token tiles beat 64
    by 13-22% (benchmarks/README.md).
    """
    return {"tile_n": 128 if head_dim <= 64 else 64, "num_warps": 4, "num_stages": 3}


def paged_decode_triton(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float,
    out: torch.Tensor | None = None,
    *,
    work: torch.Tensor | None = None,
    target_items: int | None = None,
    min_chunk_tokens: int = MIN_TOKENS_PER_ITEM,
    tile_n: int | None = None,
    num_warps: int | None = None,
    num_stages: int | None = None,
    sliding_window: int | None = None,
    softcap: float | None = None,
    k_scale: torch.Tensor | None = None,
    v_scale: torch.Tensor | None = None,
) -> torch.Tensor:
    """Paged decode, q [S, Hq, D] -> [S, Hq, D]. No host synchronisation; the launches depend on
    shapes only. An FP8 pool takes its layer's k_scale / v_scale (one fp32 element each).

    sliding_window: each query reads only its last sliding_window keys; a `work` list given
    must have been planned with the same window (plan_work(..., sliding_window=)), which is
    where the window lives. softcap: scores = softcap · tanh(scores / softcap).

    work: the step's work list from `plan_work(seq_lens, ...)`; without one it is planned here
    (one more small launch) with target_items (items per KV head; default: enough to fill the
    card; 1: no sequence is split) and min_chunk_tokens. tile_n, num_warps and num_stages
    override the tuned launch config (benchmarks and tests).
    """
    check_decode_inputs(q, k_cache, v_cache, block_tables, seq_lens)
    check_window_and_softcap(sliding_window, softcap)
    check_kv_scales(k_cache, k_scale, v_scale)
    num_seqs, num_q_heads, head_dim = q.shape
    _, block_size, num_kv_heads, _ = k_cache.shape
    out = output_for(q, out)
    if num_seqs == 0:
        return out
    config = default_launch_config(head_dim, q.dtype)
    tile_n = tile_n or config["tile_n"]
    if work is None:
        work = plan_work(seq_lens, num_kv_heads, target_items=target_items,
                         min_chunk_tokens=min_chunk_tokens, align=tile_n,
                         sliding_window=sliding_window)
    width = work.shape[1]
    if work.dtype != torch.int32 or work.shape[0] != WORK_FIELDS or width <= num_seqs \
            or work.device != q.device or not work.is_contiguous():
        raise ValueError(f"work must be plan_work's contiguous int32 [{WORK_FIELDS}, > {num_seqs}] "
                         f"list on {q.device}, got {work.dtype} {tuple(work.shape)} on {work.device}")
    group = num_q_heads // num_kv_heads
    dim_pad = triton.next_power_of_2(head_dim)
    partial_out = torch.empty((width, num_q_heads, dim_pad), dtype=torch.float32, device=q.device)
    partial_lse = torch.empty((width, num_q_heads), dtype=torch.float32, device=q.device)
    scale_arg, softcap_arg = softcap_scales(scale, softcap)
    _decode_kernel[(num_kv_heads, width)](
        q,
        k_cache,
        v_cache,
        block_tables,
        work[ITEM_SEQ],
        work[ITEM_START],
        work[ITEM_END],
        work[ITEM_COUNT],
        out,
        partial_out,
        partial_lse,
        k_scale,
        v_scale,
        scale_arg,
        softcap_arg,
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
        DOT_MODE=dot_mode(q),
        SOFTCAP=softcap is not None,
        FP8_KV=is_fp8(k_cache.dtype),
        num_warps=num_warps or config["num_warps"],
        num_stages=num_stages or config["num_stages"],
        **pdl_launch(q),
    )
    _merge_kernel[(max_merges(num_seqs, width - num_seqs), num_q_heads)](
        work[MERGES],
        work[SEQ_FIRST],
        work[SEQ_COUNT],
        partial_out,
        partial_lse,
        out,
        out.stride(0),
        out.stride(1),
        HEAD_DIM=head_dim,
        DIM_PAD=dim_pad,
        MERGE_BLOCK=MERGE_BLOCK,
        num_warps=4,
        **pdl_launch(q),
    )
    return out
