"""Triton paged decode: one query per sequence, split over work items, GQA packed, merged in place.

Grid (max items, num_kv_heads). decode_work.py cuts the batch's KV into items of about equal
size (a long sequence into many, a short one whole); program (i, h) finds its item i on the device,
reads that token range of its sequence for KV head h, following the block table tile by tile, and
computes all the query heads that share h at once (one dot of [group, D] x [D, tile]) so each K/V
byte is read once. A sequence that is one item writes its output directly. Otherwise each item
stores its normalised partial output and log-sum-exp, then counts itself in on the (sequence, KV
head)'s arrival counter; the item that arrives last merges them all (in item order, so the result
does not depend on which one that is), writes the output and resets the counter for the next
launch. No second kernel, no host synchronisation, and a grid of shapes only, so one CUDA graph
per batch size serves any mix of lengths. The counters are one set per device: decode launches
must not run concurrently on two streams of one device (a worker runs its model on one).
"""

from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl

from .decode_work import chunk_tokens, find_item, max_items
from .pdl import pdl_launch, wait_for_inputs
from .triton_common import LOG2_E, dot, dot_mode, num_sms
from .validation import check_decode_inputs, output_for


# Ints that vary from step to step are left unspecialised, so a batch size or table width that
# happens to be 1 or a multiple of 16 does not compile another variant mid-serving.
@triton.jit(do_not_specialize=["num_seqs", "target_items", "min_chunk", "stride_table_seq"])
def _decode_kernel(
    q_ptr,
    k_cache_ptr,
    v_cache_ptr,
    block_tables_ptr,
    seq_lens_ptr,
    out_ptr,
    partial_out_ptr,
    partial_lse_ptr,
    arrivals_ptr,
    num_seqs,
    target_items,
    min_chunk,
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
    SEQ_BLOCK: tl.constexpr,
    MERGE_BLOCK: tl.constexpr,
    DOT_MODE: tl.constexpr,
    USE_PDL: tl.constexpr,
):
    wait_for_inputs(USE_PDL)
    item = tl.program_id(0)
    kv_head = tl.program_id(1)
    num_kv_heads = tl.num_programs(1)
    num_q_heads = num_kv_heads * GROUP

    chunk = chunk_tokens(seq_lens_ptr, num_seqs, target_items, min_chunk, SEQ_BLOCK)
    seq, first, count, item_len, seq_len = find_item(
        seq_lens_ptr, num_seqs, item, chunk, TILE_N, SEQ_BLOCK
    )
    if seq >= num_seqs:
        return
    seq = seq.to(tl.int64)
    start = (item - first) * item_len
    end = tl.minimum(start + item_len, seq_len)

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
    if count == 1:
        out_offsets = seq * stride_out_seq + heads[:, None] * stride_out_head + dims[None, :]
        tl.store(out_ptr + out_offsets, result.to(out_ptr.dtype.element_ty), mask=out_mask)
    else:
        # partial_out [max items, Hq, DIM_PAD] fp32, partial_lse [max items, Hq] (log2).
        lse_index = item.to(tl.int64) * num_q_heads + heads
        tl.store(partial_out_ptr + lse_index[:, None] * DIM_PAD + dims[None, :], result, mask=out_mask)
        tl.store(partial_lse_ptr + lse_index, m_i + tl.log2(l_i), mask=row_ok)
        # Every thread's partial is stored before the counter moves; acq_rel at GPU scope makes
        # them visible to whichever item arrives last, and theirs to it.
        tl.debug_barrier()
        counter = arrivals_ptr + seq * num_kv_heads + kv_head
        arrived = tl.atomic_add(counter, 1, sem="acq_rel", scope="gpu")
        if arrived == count - 1:
            _merge_items(partial_out_ptr, partial_lse_ptr, out_ptr, seq, kv_head, first, count,
                         num_q_heads, stride_out_seq, stride_out_head, GROUP, HEAD_DIM, DIM_PAD,
                         MERGE_BLOCK)
            tl.atomic_xchg(counter, 0, sem="relaxed", scope="gpu")


@triton.jit
def _merge_items(partial_out_ptr, partial_lse_ptr, out_ptr, seq, kv_head, first, count,
                 num_q_heads, stride_out_seq, stride_out_head, GROUP: tl.constexpr,
                 HEAD_DIM: tl.constexpr, DIM_PAD: tl.constexpr, MERGE_BLOCK: tl.constexpr):
    """out[seq, h] for the GROUP query heads h of kv_head: the partials of items first..first+count-1
    weighted by their log-sum-exp, MERGE_BLOCK items per load."""
    dims = tl.arange(0, DIM_PAD)
    for row in tl.static_range(GROUP):
        head = kv_head * GROUP + row
        m = tl.full([1], float("-inf"), tl.float32)
        total = tl.zeros([1], tl.float32)
        acc = tl.zeros([DIM_PAD], tl.float32)
        for block in range(0, count, MERGE_BLOCK):
            items = block + tl.arange(0, MERGE_BLOCK)
            valid = items < count
            index = (first + items).to(tl.int64) * num_q_heads + head
            # .cg: the other items' partials were written by other SMs; skip this SM's L1.
            lse = tl.load(partial_lse_ptr + index, mask=valid, other=float("-inf"),
                          cache_modifier=".cg")
            partial = tl.load(partial_out_ptr + index[:, None] * DIM_PAD + dims[None, :],
                              mask=valid[:, None], other=0.0, cache_modifier=".cg")
            m_new = tl.maximum(m, tl.max(lse, 0))
            alpha = tl.exp2(m - m_new)
            weights = tl.exp2(lse - m_new)
            total = total * alpha + tl.sum(weights, 0)
            acc = acc * alpha + tl.sum(partial * weights[:, None], 0)
            m = m_new
        tl.store(out_ptr + seq * stride_out_seq + head * stride_out_head + dims,
                 (acc / total).to(out_ptr.dtype.element_ty), mask=dims < HEAD_DIM)


# Each item should stream at least this many tokens, or the merge costs more than it saves. On the
# H200 one sequence of 1,024 tokens took less time in 8 splits than in 4 (bench_kernels.py
# --tune decode): at short contexts the latency of an item's serial tiles, not the merge, is
# what costs.
MIN_TOKENS_PER_ITEM = 128
# Programs per multiprocessor to aim for, so memory latency is hidden by many loads in flight.
TARGET_PROGRAMS_PER_SM = 4
# Sequences a program reads at once when it looks for its item (more take a loop).
SEQ_BLOCKS = (16, 128, 1024)
MERGE_BLOCK = 32
# Arrival counters per device: one per (sequence, KV head) of a launch.
_MAX_ARRIVALS = 1 << 16


def default_target_items(num_kv_heads: int, sm_count: int) -> int:
    """Items per KV head the plan aims for: TARGET_PROGRAMS_PER_SM programs on every SM."""
    return max(TARGET_PROGRAMS_PER_SM * sm_count // num_kv_heads, 1)


def seq_block(num_seqs: int) -> int:
    """The SEQ_BLOCK variant a batch of num_seqs compiles (three in all: see warmup.py)."""
    return next((b for b in SEQ_BLOCKS if num_seqs <= b), SEQ_BLOCKS[-1])


@functools.cache
def _arrivals(device: torch.device) -> torch.Tensor:
    """The arrival counters of `device`: allocated once and kept, since captured CUDA graphs
    hold their address; every launch leaves them at zero."""
    return torch.zeros(_MAX_ARRIVALS, dtype=torch.int32, device=device)


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
    target_items: int | None = None,
    min_chunk_tokens: int = MIN_TOKENS_PER_ITEM,
    tile_n: int | None = None,
    num_warps: int | None = None,
    num_stages: int | None = None,
) -> torch.Tensor:
    """Paged decode, q [S, Hq, D] -> [S, Hq, D]. No host synchronisation; the launch depends on
    shapes only.

    target_items (items per KV head the batch's KV is cut into; default: enough to fill the
    card, `default_target_items`; 1: no sequence is split), min_chunk_tokens, tile_n, num_warps and
    num_stages override the tuned defaults (benchmarks and tests).
    """
    check_decode_inputs(q, k_cache, v_cache, block_tables, seq_lens)
    num_seqs, num_q_heads, head_dim = q.shape
    _, block_size, num_kv_heads, _ = k_cache.shape
    out = output_for(q, out)
    if num_seqs == 0:
        return out
    if num_seqs * num_kv_heads > _MAX_ARRIVALS:
        raise ValueError(f"{num_seqs} sequences x {num_kv_heads} KV heads exceed the decode "
                         f"kernel's {_MAX_ARRIVALS} arrival counters")
    if target_items is None:
        target_items = default_target_items(num_kv_heads, num_sms(q.device))
    if target_items < 1 or min_chunk_tokens < 1:
        raise ValueError(f"target_items ({target_items}) and min_chunk_tokens "
                         f"({min_chunk_tokens}) must be >= 1")
    config = default_launch_config(head_dim, q.dtype)
    tile_n = tile_n or config["tile_n"]
    group = num_q_heads // num_kv_heads
    dim_pad = triton.next_power_of_2(head_dim)
    grid_items = max_items(num_seqs, target_items)
    partial_out = torch.empty((grid_items, num_q_heads, dim_pad), dtype=torch.float32,
                              device=q.device)
    partial_lse = torch.empty((grid_items, num_q_heads), dtype=torch.float32, device=q.device)
    _decode_kernel[(grid_items, num_kv_heads)](
        q,
        k_cache,
        v_cache,
        block_tables,
        seq_lens,
        out,
        partial_out,
        partial_lse,
        _arrivals(q.device),
        num_seqs,
        target_items,
        min_chunk_tokens,
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
        SEQ_BLOCK=seq_block(num_seqs),
        MERGE_BLOCK=MERGE_BLOCK,
        DOT_MODE=dot_mode(q),
        num_warps=num_warps or config["num_warps"],
        num_stages=num_stages or config["num_stages"],
        **pdl_launch(q),
    )
    return out
