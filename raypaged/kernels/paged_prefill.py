"""Triton paged prefill / extend: varlen causal attention over a cached prefix and new tokens.

One kernel serves first prefill, chunked prefill and prefix-cache hits: request s has
seq_lens[s] positions in the cache, the last q_len_s of which are its new tokens (already
written). Flash-attention style: a program owns BLOCK_M new tokens of one request and one query
head, and streams that request's K/V in BLOCK_N-token tiles with an online softmax.

Where the keys come from (NEW_KV):
  "cache": every key through the block table (per-row gathers, cp.async on Hopper).
  "ptr" / "tma": the cached prefix through the block table, the new tokens from the step's own
    contiguous k/v [T, Hkv, D] (the layer has them in hand before writing them into the pool),
    with plain pointers or with TMA tensor descriptors. A first prefill is all new tokens, so it
    never touches the table. This is how vLLM's Triton prefix-prefill kernel splits the work.
Each source runs an unmasked loop over the tiles every row of the program sees in full (no
causal mask, no bounds checks) and a masked loop over the rest (the diagonal, a ragged end).

A sliding window W (HAS_WINDOW; query p sees keys (p - W, p]) adds a masked loop at the window's
lower edge and skips every tile wholly before the program's earliest window: those K/V are never
loaded, and a table entry of -1 there (a block a sliding KV-cache group gave back) is never
loaded through. Soft-capping (SOFTCAP) maps each score s to c · tanh(s / c) before the softmax.

An FP8 pool (FP8_KV, kernels/kv_quant.py) is widened to the queries' dtype as it is read, its
layer's K scale folded into the softmax scale and its V scale into the output. The new tokens
read from the step's own k/v are quantized in the tile exactly as the write kernel stored them,
so every key is the same number whichever source it comes from (and decode reads it later).

The grid is (num_q_heads, num_tokens // BLOCK_M + num_seqs): the second is an upper bound on the
query tiles of any varlen batch of that many tokens and requests, so it depends on shapes only.
Request s owns tile indices from query_start_loc[s] // BLOCK_M + s on; each program finds its
request by binary search and exits if its tile is past the request's tokens.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .kv_quant import is_fp8, round_fp8_args
from .prefill_tiles import attend_new, attend_paged, window_tiles
from .triton_common import dot_mode, softcap_scales
from .validation import check_kv_scales, check_prefill_inputs, check_window_and_softcap, output_for

try:  # host-side TMA descriptors: triton >= 3.4
    from triton.tools.tensor_descriptor import TensorDescriptor
except ImportError:  # pragma: no cover - older triton: the "tma" source falls back to "ptr"
    TensorDescriptor = None

NEW_KV_SOURCES = {"cache": 0, "ptr": 1, "tma": 2}


# num_seqs and the block table's row stride change every step: left unspecialised (see
# paged_decode.py), so their values never compile another variant mid-serving.
@triton.jit(do_not_specialize=["num_seqs", "stride_table_seq", "window"])
def _prefill_kernel(
    q_ptr, k_cache_ptr, v_cache_ptr, block_tables_ptr, query_start_loc_ptr, seq_lens_ptr, out_ptr,
    k_new_ptr, v_new_ptr, k_desc, v_desc, k_scale_ptr, v_scale_ptr,
    scale_log2, num_seqs, softcap_log2, window,
    stride_q_tok, stride_q_head,
    stride_cache_block, stride_cache_slot, stride_cache_head,
    stride_table_seq, stride_out_tok, stride_out_head,
    stride_new_tok, stride_new_head,
    GROUP: tl.constexpr, HEAD_DIM: tl.constexpr, DIM_PAD: tl.constexpr,
    BLOCK_SIZE: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    HEADS_PER_PROGRAM: tl.constexpr, NEW_KV: tl.constexpr, WARP_SPECIALIZE: tl.constexpr,
    DOT_MODE: tl.constexpr, SOFTCAP: tl.constexpr, HAS_WINDOW: tl.constexpr,
    FP8_KV: tl.constexpr, FP8_MAX: tl.constexpr, E5M2: tl.constexpr,
):
    # A program owns BLOCK_M rows = TILE_TOKENS new tokens x HEADS_PER_PROGRAM query heads of
    # one KV head (row r: token r // HEADS_PER_PROGRAM, head r % HEADS_PER_PROGRAM), so with
    # HEADS_PER_PROGRAM = GROUP each K/V tile is loaded once for the whole GQA group.
    TILE_TOKENS: tl.constexpr = BLOCK_M // HEADS_PER_PROGRAM
    EVEN_DIM: tl.constexpr = HEAD_DIM == DIM_PAD
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
    k_scale = 1.0
    v_scale = 1.0
    if FP8_KV:
        k_scale = tl.load(k_scale_ptr)
        v_scale = tl.load(v_scale_ptr)
        scale_log2 = scale_log2 * k_scale
    table_row = block_tables_ptr + seq.to(tl.int64) * stride_table_seq
    kv_head = first_head // GROUP
    head_offset = kv_head.to(tl.int64) * stride_cache_head
    kv_end = prefix_len + tl.minimum(m_start + TILE_TOKENS, q_len)
    # Under a window the program's earliest row sees keys from key_floor on, its latest from
    # key_full on; without one both are 0 and the edge loops below are empty.
    key_floor = 0
    key_full = 0
    if HAS_WINDOW:
        key_floor = tl.maximum(prefix_len + m_start - window + 1, 0)
        key_full = tl.maximum(kv_end - window, 0)
    if NEW_KV == 0:
        # All keys through the table. Every key before the tile's first query is visible to
        # all its rows; the rest is the diagonal.
        paged_split = ((prefix_len + m_start) // BLOCK_N) * BLOCK_N
        paged_end = kv_end
    else:
        # Only the cached prefix through the table. It is visible to every new token: only its
        # ragged end needs a mask.
        paged_split = (prefix_len // BLOCK_N) * BLOCK_N
        paged_end = prefix_len
    # Tiles: [lo, edge_end) the window's masked edge, then unmasked to paged_split, then masked.
    lo, edge_end = window_tiles(key_floor, key_full, 0, paged_split, BLOCK_N)
    acc, m_i, l_i = attend_paged(
        acc, m_i, l_i, q, k_cache_ptr, v_cache_ptr, table_row, head_offset, query_pos,
        lo, edge_end, scale_log2, stride_cache_block,
        stride_cache_slot, dims, dim_ok, True, EVEN_DIM, BLOCK_SIZE, BLOCK_N, DOT_MODE,
        softcap_log2, window, key_floor, SOFTCAP, HAS_WINDOW, FP8_KV)
    acc, m_i, l_i = attend_paged(
        acc, m_i, l_i, q, k_cache_ptr, v_cache_ptr, table_row, head_offset, query_pos,
        tl.maximum(edge_end, lo), paged_split, scale_log2, stride_cache_block,
        stride_cache_slot, dims, dim_ok, False, EVEN_DIM, BLOCK_SIZE, BLOCK_N, DOT_MODE,
        softcap_log2, window, key_floor, SOFTCAP, HAS_WINDOW, FP8_KV)
    acc, m_i, l_i = attend_paged(
        acc, m_i, l_i, q, k_cache_ptr, v_cache_ptr, table_row, head_offset, query_pos,
        tl.maximum(paged_split, lo), paged_end, scale_log2, stride_cache_block,
        stride_cache_slot, dims, dim_ok, True, EVEN_DIM, BLOCK_SIZE, BLOCK_N, DOT_MODE,
        softcap_log2, window, key_floor, SOFTCAP, HAS_WINDOW, FP8_KV)
    if NEW_KV != 0:
        # New tokens: tiles start at prefix_len, so with BLOCK_N | TILE_TOKENS the diagonal is
        # exactly the program's own tokens and everything before it runs unmasked.
        new_unmasked_end = prefix_len + (m_start // BLOCK_N) * BLOCK_N
        row_base = q_start - prefix_len  # row of sequence position p in k_new / v_new
        k_head_ptr = k_new_ptr + kv_head.to(tl.int64) * stride_new_head
        v_head_ptr = v_new_ptr + kv_head.to(tl.int64) * stride_new_head
        desc_col = kv_head * HEAD_DIM
        new_lo, new_edge_end = window_tiles(key_floor, key_full, prefix_len, new_unmasked_end,
                                             BLOCK_N)
        acc, m_i, l_i = attend_new(
            acc, m_i, l_i, q, k_head_ptr, v_head_ptr, k_desc, v_desc, row_base, desc_col, query_pos,
            new_lo, new_edge_end, scale_log2, stride_new_tok,
            dims, dim_ok, True, EVEN_DIM, BLOCK_N, NEW_KV, False, DOT_MODE,
            softcap_log2, window, key_floor, SOFTCAP, HAS_WINDOW, k_scale, v_scale, FP8_KV,
            FP8_MAX, E5M2)
        acc, m_i, l_i = attend_new(
            acc, m_i, l_i, q, k_head_ptr, v_head_ptr, k_desc, v_desc, row_base, desc_col, query_pos,
            tl.maximum(new_edge_end, new_lo), new_unmasked_end, scale_log2, stride_new_tok,
            dims, dim_ok, False, EVEN_DIM, BLOCK_N, NEW_KV, WARP_SPECIALIZE, DOT_MODE,
            softcap_log2, window, key_floor, SOFTCAP, HAS_WINDOW, k_scale, v_scale, FP8_KV,
            FP8_MAX, E5M2)
        acc, m_i, l_i = attend_new(
            acc, m_i, l_i, q, k_head_ptr, v_head_ptr, k_desc, v_desc, row_base, desc_col, query_pos,
            tl.maximum(new_unmasked_end, new_lo), kv_end, scale_log2, stride_new_tok,
            dims, dim_ok, True, EVEN_DIM, BLOCK_N, NEW_KV, False, DOT_MODE,
            softcap_log2, window, key_floor, SOFTCAP, HAS_WINDOW, k_scale, v_scale, FP8_KV,
            FP8_MAX, E5M2)

    result = acc / tl.where(l_i > 0, l_i, 1.0)[:, None]
    if FP8_KV:
        result = result * v_scale
    tl.store(
        out_ptr + (tokens * stride_out_tok + heads * stride_out_head)[:, None] + dims[None, :],
        result.to(out_ptr.dtype.element_ty),
        mask=q_mask,
    )


# Named launch configurations. benchmarks/bench_prefill_variants.py checks and times every one of
# them; CUDA_DEFAULT picks the one used for 16-bit inputs on CUDA (one line to change).
VARIANTS: dict[str, dict] = {
    # The previous default: every new token's K/V read through the block table.
    "baseline": dict(new_kv="cache", block_m=128, block_n=128, num_warps=8, num_stages=3),
    "ptr": dict(new_kv="ptr", block_m=128, block_n=128, num_warps=8, num_stages=3),
    "ptr_n64_w4": dict(new_kv="ptr", block_m=128, block_n=64, num_warps=4, num_stages=3),
    "tma": dict(new_kv="tma", block_m=128, block_n=128, num_warps=8, num_stages=3),
    "tma_s2": dict(new_kv="tma", block_m=128, block_n=128, num_warps=8, num_stages=2),
    "tma_s4": dict(new_kv="tma", block_m=128, block_n=128, num_warps=8, num_stages=4),
    "tma_n64_w4": dict(new_kv="tma", block_m=128, block_n=64, num_warps=4, num_stages=3),
    "tma_n64_w4_s4": dict(new_kv="tma", block_m=128, block_n=64, num_warps=4, num_stages=4),
    "tma_n64_w8": dict(new_kv="tma", block_m=128, block_n=64, num_warps=8, num_stages=3),
    "tma_pack": dict(new_kv="tma", block_m=128, block_n=128, num_warps=8, num_stages=3,
                     pack_gqa=True),
    "tma_ws": dict(new_kv="tma", block_m=128, block_n=128, num_warps=8, num_stages=3,
                   warp_specialize=True),
}
# On the H200 "tma" was the fastest (benchmarks/results/prefill_variants_h200.json), tma_pack and
# tma_ws within noise of it: the simplest of the three is the default.
CUDA_DEFAULT = "tma"
WIDE_HEAD_VARIANT = dict(new_kv="tma", block_m=64, block_n=64, num_warps=4, num_stages=2)
_COMMON = {"pack_gqa": False, "warp_specialize": False}


def default_launch_config(head_dim: int, dtype: torch.dtype, device: torch.device) -> dict:
    """Source of the new tokens' K/V, tile sizes, warps, stages, GQA packing.

    The CPU interpreter pays per program and per loop step, not per element: big tiles there;
    it runs the TMA source too (descriptor loads are emulated), so tests cover that path.
    """
    if device.type != "cuda":
        return {**_COMMON, "new_kv": "tma", "block_m": 64, "block_n": 64, "num_warps": 4,
                "num_stages": 1}
    if dtype == torch.float32:
        return {**_COMMON, "new_kv": "ptr", "block_m": 32, "block_n": 32, "num_warps": 4,
                "num_stages": 2}
    if head_dim > 128:
        # Gemma 2's 256-wide heads: the default's 128 x 128 tiles over three stages want 450 KB
        # of shared memory, twice what an SM has.
        return {**_COMMON, **WIDE_HEAD_VARIANT}
    return {**_COMMON, **VARIANTS[CUDA_DEFAULT]}


def _new_kv_usable(k_new, v_new, k_cache, q) -> bool:
    """The step's own k/v can stand in for the new tokens' cache slots (same values, layout)."""
    if k_new is None or v_new is None:
        return False
    expected = (q.shape[0], *k_cache.shape[2:])
    for t in (k_new, v_new):
        if tuple(t.shape) != expected:
            raise ValueError(f"k_new/v_new must be {expected}, got {tuple(t.shape)}")
        if t.device != q.device:
            raise ValueError(f"k_new/v_new on {t.device}, expected {q.device}")
    # The kernel shares one (token, head) stride pair between k_new and v_new. An FP8 pool's
    # new tokens come in q's dtype (the kernel quantizes them as the pool holds them).
    cache_ok = k_cache.dtype == q.dtype or is_fp8(k_cache.dtype)
    return (k_new.dtype == v_new.dtype == q.dtype and cache_ok
            and k_new.stride() == v_new.stride() and k_new.stride(2) == 1)


def _descriptor(t: torch.Tensor, block_n: int) -> TensorDescriptor | None:
    """[T, Hkv, D] as a 2-D [T, Hkv*D] TMA descriptor of [block_n, D] boxes, or None if the
    layout cannot be described (TMA needs 16-byte aligned base and row stride)."""
    tokens, heads, dim = t.shape
    if TensorDescriptor is None or t.stride(1) != dim or t.element_size() == 4:
        return None
    if t.data_ptr() % 16 or (t.stride(0) * t.element_size()) % 16 or dim & (dim - 1):
        return None
    return TensorDescriptor(t, [tokens, heads * dim], [t.stride(0), 1], [block_n, dim])


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
    k_new: torch.Tensor | None = None,
    v_new: torch.Tensor | None = None,
    variant: str | None = None,
    new_kv: str | None = None,
    block_m: int | None = None,
    block_n: int | None = None,
    num_warps: int | None = None,
    num_stages: int | None = None,
    pack_gqa: bool | None = None,
    warp_specialize: bool | None = None,
    sliding_window: int | None = None,
    softcap: float | None = None,
    k_scale: torch.Tensor | None = None,
    v_scale: torch.Tensor | None = None,
) -> torch.Tensor:
    """Varlen causal paged attention, q [T, Hq, D] -> [T, Hq, D]. No host synchronisation.
    An FP8 pool takes its layer's k_scale / v_scale (one fp32 element each).

    k_new / v_new [T, Hkv, D]: this step's keys/values, the same values that were written into
    the cache for q's tokens. Given, the new tokens are read from them rather than through the
    block table (when the chosen config says so); absent, everything comes from the cache.
    variant names an entry of VARIANTS; the other keywords override single settings (tests,
    benchmarks). sliding_window: query p sees keys (p - W, p] only; softcap: scores =
    softcap · tanh(scores / softcap).
    """
    check_prefill_inputs(q, k_cache, v_cache, block_tables, query_start_loc, seq_lens)
    check_window_and_softcap(sliding_window, softcap)
    check_kv_scales(k_cache, k_scale, v_scale)
    num_tokens, num_q_heads, head_dim = q.shape
    _, block_size, num_kv_heads, _ = k_cache.shape
    out = output_for(q, out)
    num_seqs = seq_lens.shape[0]
    if num_tokens == 0 or num_seqs == 0:
        return out
    config = default_launch_config(head_dim, q.dtype, q.device)
    if variant is not None:
        config = {**_COMMON, **VARIANTS[variant]}
    overrides = dict(new_kv=new_kv, block_m=block_m, block_n=block_n, num_warps=num_warps,
                     num_stages=num_stages, pack_gqa=pack_gqa, warp_specialize=warp_specialize)
    config.update({k: v for k, v in overrides.items() if v is not None})
    if config["new_kv"] not in NEW_KV_SOURCES:
        raise ValueError(f"new_kv must be one of {tuple(NEW_KV_SOURCES)}, got {config['new_kv']!r}")
    source = config["new_kv"] if _new_kv_usable(k_new, v_new, k_cache, q) else "cache"
    block_m, block_n = config["block_m"], config["block_n"]
    k_desc = v_desc = None
    if source == "tma" and k_new is not None and v_new is not None:  # given: _new_kv_usable
        k_desc, v_desc = _descriptor(k_new, block_n), _descriptor(v_new, block_n)
        if k_desc is None or v_desc is None:
            source = "ptr"
    if source == "cache":
        k_new = v_new = None
    group = num_q_heads // num_kv_heads
    heads_per_program = group if config["pack_gqa"] and block_m % group == 0 else 1
    grid = (num_q_heads // heads_per_program, num_tokens // (block_m // heads_per_program) + num_seqs)
    scale_arg, softcap_arg = softcap_scales(scale, softcap)
    _prefill_kernel[grid](
        q, k_cache, v_cache, block_tables, query_start_loc, seq_lens, out,
        k_new, v_new, k_desc, v_desc, k_scale, v_scale,
        scale_arg, num_seqs, softcap_arg, sliding_window or 0,
        q.stride(0), q.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        block_tables.stride(0), out.stride(0), out.stride(1),
        *(k_new.stride()[:2] if k_new is not None else (0, 0)),
        GROUP=group,
        HEAD_DIM=head_dim,
        DIM_PAD=triton.next_power_of_2(head_dim),
        BLOCK_SIZE=block_size,
        BLOCK_M=block_m,
        BLOCK_N=block_n,
        HEADS_PER_PROGRAM=heads_per_program,
        NEW_KV=NEW_KV_SOURCES[source],
        WARP_SPECIALIZE=bool(config["warp_specialize"]) and source != "cache",
        DOT_MODE=dot_mode(q),
        SOFTCAP=softcap is not None,
        HAS_WINDOW=sliding_window is not None,
        FP8_KV=is_fp8(k_cache.dtype),
        **round_fp8_args(k_cache.dtype),
        num_warps=config["num_warps"],
        num_stages=config["num_stages"],
    )
    return out
