"""Torch references for the kernels: the test oracle for the Triton kernels and the CPU serving
path (ops' "torch" backend).

The paged-attention references are vectorised per request (one gather and two matmuls per
request, no per-token loops) and never let a NaN from an unused slot reach the arithmetic: each
request gathers exactly its valid positions before any matmul.

The elementwise references (RMSNorm, SiLU·mul) are transformers' exact arithmetic, rounding to
the activation dtype where transformers does; the CPU tests compare the model against
transformers tightly through them. The rope references are the kernels' arithmetic (fp32 tables,
one rounding); the model's CPU path rotates as transformers does (model/rotary.py).

Sliding window W (Mistral, Gemma's local layers): a query at position p attends keys in
(p - W, p], transformers' mask (`kv_idx > q_idx - sliding_window`); keys before the earliest
query's window are never gathered. Logit soft-capping c (Gemma 2): scores = c · tanh(scores / c)
after the scale, before the mask, as transformers' eager attention does.

FP8 pools (kernels/kv_quant.py): the write quantizes with the layer's k_scale / v_scale, the
attention references dequantize what they gather (q · scale, fp32) before any arithmetic.

Shapes (Hq query heads, Hkv KV heads, Hq % Hkv == 0, D head dim, B block size):
  k_cache, v_cache   [num_blocks, B, Hkv, D]
  block_tables       [S, max_blocks] int32   logical block i of request s -> physical block id
  seq_lens           [S] int32               context length incl. the tokens being computed
  slot_mapping       [T] int64               block_id * B + offset, -1 for padding
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from .kv_quant import dequantize_kv, is_fp8, quantize_kv
from .validation import (
    check_cache_pair,
    check_decode_inputs,
    check_kv_scales,
    check_prefill_inputs,
    check_table_contents,
    check_window_and_softcap,
    check_write_inputs,
)


def write_kv_ref(
    key: torch.Tensor,
    value: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    k_scale: torch.Tensor | None = None,
    v_scale: torch.Tensor | None = None,
) -> None:
    """Store key/value [T, Hkv, D] into the pools at slot_mapping; slot -1 writes nothing. An
    FP8 pool stores them quantized with k_scale / v_scale (kv_quant.quantize_kv)."""
    check_write_inputs(key, value, k_cache, v_cache, slot_mapping)
    check_kv_scales(k_cache, k_scale, v_scale)
    block_size = k_cache.shape[1]
    capacity = k_cache.shape[0] * block_size
    valid = slot_mapping >= 0
    slots = slot_mapping[valid]
    # Checked before any write so that bad input changes no state.
    if slots.numel() and int(slots.max()) >= capacity:
        raise ValueError(f"slot_mapping holds slot {int(slots.max())} >= pool capacity {capacity}")
    if slots.numel() and int(torch.unique(slots).numel()) != slots.numel():
        raise ValueError("slot_mapping writes the same slot twice")
    if (slot_mapping < -1).any():
        raise ValueError("slot_mapping entries must be >= -1")
    blocks, offsets = slots // block_size, slots % block_size
    # Advanced indexing on (block, offset) works for any cache strides (no flat view needed).
    if k_scale is not None and v_scale is not None:  # an FP8 pool (checked above)
        # As bytes: indexed stores of FP8 are not implemented on every device.
        k_cache.view(torch.uint8)[blocks, offsets] = quantize_kv(key[valid], k_scale, k_cache.dtype).view(torch.uint8)
        v_cache.view(torch.uint8)[blocks, offsets] = quantize_kv(value[valid], v_scale, v_cache.dtype).view(torch.uint8)
        return
    k_cache[blocks, offsets] = key[valid].to(k_cache.dtype)
    v_cache[blocks, offsets] = value[valid].to(v_cache.dtype)


def _gather_context(
    cache: torch.Tensor, block_row: torch.Tensor, length: int, start: int = 0
) -> torch.Tensor:
    """Positions [start, length) of one request, [length - start, Hkv, D], read through its
    blocks (only the blocks holding them: a window's earlier blocks are never touched)."""
    block_size = cache.shape[1]
    first_block, num_blocks = start // block_size, -(-length // block_size)
    blocks = block_row[first_block:num_blocks].long()
    # Slicing before any arithmetic drops the slots outside [start, length). An FP8 pool is
    # gathered as bytes (indexed loads of FP8 are not implemented on every device).
    picked = cache.view(torch.uint8)[blocks].view(cache.dtype) if is_fp8(cache.dtype) else cache[blocks]
    flat = picked.reshape((num_blocks - first_block) * block_size, *cache.shape[2:])
    return flat[start - first_block * block_size : length - first_block * block_size]


def _attend(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    first_query_pos: int,
    scale: float,
    compute_dtype: torch.dtype,
    first_key_pos: int = 0,
    sliding_window: int | None = None,
    softcap: float | None = None,
) -> torch.Tensor:
    """Causal GQA attention of q [n, Hq, D] at positions first_query_pos.. over k/v [L, Hkv, D]
    at positions first_key_pos.., within the sliding window if given, scores soft-capped."""
    n, num_heads, head_dim = q.shape
    length, num_kv_heads, _ = k.shape
    group = num_heads // num_kv_heads
    qg = q.to(compute_dtype).reshape(n, num_kv_heads, group, head_dim)
    kc, vc = k.to(compute_dtype), v.to(compute_dtype)
    scores = torch.einsum("nhgd,lhd->hgnl", qg, kc).float() * scale
    if softcap is not None:
        scores = torch.tanh(scores / softcap) * softcap
    query_pos = first_query_pos + torch.arange(n, device=q.device)
    key_pos = first_key_pos + torch.arange(length, device=q.device)
    hidden = key_pos[None, :] > query_pos[:, None]
    if sliding_window is not None:
        hidden |= key_pos[None, :] <= query_pos[:, None] - sliding_window
    scores.masked_fill_(hidden, float("-inf"))
    probs = torch.softmax(scores, dim=-1).to(compute_dtype)
    out = torch.einsum("hgnl,lhd->nhgd", probs, vc)
    return out.reshape(n, num_heads, head_dim)


def _first_key(first_query_pos: int, sliding_window: int | None) -> int:
    """The first key position a request's earliest query reads."""
    return 0 if sliding_window is None else max(0, first_query_pos - sliding_window + 1)


def _request_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_row: torch.Tensor,
    length: int,
    scale: float,
    compute_dtype: torch.dtype,
    sliding_window: int | None = None,
    softcap: float | None = None,
    k_scale: torch.Tensor | None = None,
    v_scale: torch.Tensor | None = None,
) -> torch.Tensor:
    """One request's new queries q [n, Hq, D] (the last n of its `length` positions)."""
    if q.shape[0] > length:
        raise ValueError(f"{q.shape[0]} new tokens but seq_len is only {length}")
    if length == 0:
        return torch.zeros_like(q)
    first_query_pos = length - q.shape[0]
    # The earliest query's window starts here: nothing before it is read.
    start = _first_key(first_query_pos, sliding_window)
    k = _gather_context(k_cache, block_row, length, start)
    v = _gather_context(v_cache, block_row, length, start)
    if k_scale is not None and v_scale is not None:  # an FP8 pool
        k, v = dequantize_kv(k, k_scale), dequantize_kv(v, v_scale)
    return _attend(q, k, v, first_query_pos, scale, compute_dtype, start, sliding_window,
                   softcap).to(q.dtype)


def paged_prefill_ref(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    query_start_loc: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float,
    *,
    compute_dtype: torch.dtype = torch.float32,
    sliding_window: int | None = None,
    softcap: float | None = None,
    k_scale: torch.Tensor | None = None,
    v_scale: torch.Tensor | None = None,
) -> torch.Tensor:
    """Varlen causal attention of new tokens over cached prefix + themselves (within the
    sliding window if given, scores soft-capped at `softcap` if given; module docstring).
    k_scale / v_scale: an FP8 pool's scales (its values are dequantized before any product).

    q [T, Hq, D]; query_start_loc [S+1] int32; seq_lens [S] int32 (prefix + new tokens, all
    already in the cache). Query i of request s sits at position seq_lens[s] - q_len_s + i.
    compute_dtype sets the matmul precision (softmax is always fp32): float32 is the oracle;
    the input dtype gives a same-precision baseline to judge a low-precision kernel's error.
    Returns [T, Hq, D] in q's dtype.
    """
    check_prefill_inputs(q, k_cache, v_cache, block_tables, query_start_loc, seq_lens)
    check_window_and_softcap(sliding_window, softcap)
    check_kv_scales(k_cache, k_scale, v_scale)
    starts = query_start_loc.tolist()
    lengths = seq_lens.tolist()
    firsts = [_first_key(length - (b - a), sliding_window)
              for length, a, b in zip(lengths, starts, starts[1:])]
    check_table_contents(block_tables, lengths, k_cache.shape[0], k_cache.shape[1], firsts)
    if starts[0] != 0 or starts[-1] != q.shape[0] or any(a > b for a, b in zip(starts, starts[1:])):
        raise ValueError(f"query_start_loc must rise from 0 to {q.shape[0]}, got {starts}")
    out = torch.empty_like(q)
    for s, length in enumerate(lengths):
        rows = slice(starts[s], starts[s + 1])
        out[rows] = _request_attention(
            q[rows], k_cache, v_cache, block_tables[s], length, scale, compute_dtype,
            sliding_window, softcap, k_scale, v_scale,
        )
    return out


def paged_decode_ref(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float,
    *,
    compute_dtype: torch.dtype = torch.float32,
    sliding_window: int | None = None,
    softcap: float | None = None,
    k_scale: torch.Tensor | None = None,
    v_scale: torch.Tensor | None = None,
) -> torch.Tensor:
    """One query token per request (its last position, already written). q [S, Hq, D].

    A request with seq_len 0 (batch padding) gets zeros. sliding_window, softcap, k_scale,
    v_scale: as prefill's.
    """
    check_decode_inputs(q, k_cache, v_cache, block_tables, seq_lens)
    check_window_and_softcap(sliding_window, softcap)
    check_kv_scales(k_cache, k_scale, v_scale)
    lengths = seq_lens.tolist()
    firsts = [_first_key(length - 1, sliding_window) for length in lengths]
    check_table_contents(block_tables, lengths, k_cache.shape[0], k_cache.shape[1], firsts)
    out = torch.empty_like(q)
    for s, length in enumerate(lengths):
        if length == 0:  # batch padding attends to nothing
            out[s] = 0
            continue
        out[s : s + 1] = _request_attention(
            q[s : s + 1], k_cache, v_cache, block_tables[s], length, scale, compute_dtype,
            sliding_window, softcap, k_scale, v_scale,
        )
    return out


def copy_blocks_ref(
    k_caches: list[torch.Tensor],
    v_caches: list[torch.Tensor],
    block_copies: torch.Tensor,
) -> None:
    """Copy-on-write: for each row (src, dst) of block_copies [N, 2] int64, in every layer's pool."""
    if len(k_caches) != len(v_caches):
        raise ValueError(f"{len(k_caches)} key pools but {len(v_caches)} value pools")
    if block_copies.dim() != 2 or block_copies.shape[1] != 2:
        raise ValueError(f"block_copies must be [N, 2], got {tuple(block_copies.shape)}")
    if block_copies.numel() == 0:
        return
    for k_cache, v_cache in zip(k_caches, v_caches):
        check_cache_pair(k_cache, v_cache)
    num_blocks = k_caches[0].shape[0] if k_caches else 0
    if k_caches and (int(block_copies.min()) < 0 or int(block_copies.max()) >= num_blocks):
        raise ValueError(f"block_copies ids must be in [0, {num_blocks})")
    if int(torch.unique(block_copies[:, 1]).numel()) != block_copies.shape[0]:
        raise ValueError("block_copies names the same destination twice")
    for pool in (*k_caches, *v_caches):
        index = block_copies.to(pool.device)
        # Bytes, for an FP8 pool: index_copy_ has no FP8 kernel (the copy is exact either way).
        cache = pool.view(torch.uint8) if is_fp8(pool.dtype) else pool
        # index_select gathers every source before any destination is overwritten.
        cache.index_copy_(0, index[:, 1], cache.index_select(0, index[:, 0]))


def rms_norm_ref(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """weight * x / rms(x) over the last dim, normalised in fp32 and cast back before the weight
    (transformers' LlamaRMSNorm)."""
    x32 = x.float()
    normed = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)
    return weight * normed.to(x.dtype)


def add_rms_norm_ref(
    x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """(rms_norm(x + residual), x + residual): the pre-norm decoder's residual step."""
    summed = residual + x
    return rms_norm_ref(summed, weight, eps), summed


def gemma_rms_norm_ref(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """x / rms(x) · (1 + weight) over the last dim, all in fp32 and rounded once to x's dtype
    (transformers' Gemma2RMSNorm: the checkpoint stores weight - 1)."""
    x32 = x.float()
    normed = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)
    return (normed * (1.0 + weight.float())).to(x.dtype)


def add_gemma_rms_norm_ref(
    x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """(gemma_rms_norm(x + residual), x + residual)."""
    summed = residual + x
    return gemma_rms_norm_ref(summed, weight, eps), summed


def gelu_tanh_and_mul_ref(gate_up: torch.Tensor) -> torch.Tensor:
    """[T, 2I] (gate | up) -> gelu_tanh(gate) * up, [T, I] (Gemma's GeGLU)."""
    gate, up = gate_up.chunk(2, dim=-1)
    return F.gelu(gate, approximate="tanh") * up


def silu_and_mul_ref(gate_up: torch.Tensor) -> torch.Tensor:
    """[T, 2I] (gate | up) -> silu(gate) * up, [T, I]."""
    gate, up = gate_up.chunk(2, dim=-1)
    return F.silu(gate) * up


def rope_tables_ref(positions: torch.Tensor,
                    inv_freq: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sin of position · inv_freq, fp32 [T, D/2]."""
    angles = positions.float()[:, None] * inv_freq.float()[None, :]
    return angles.cos(), angles.sin()


def rope_in_place_ref(query: torch.Tensor, key: torch.Tensor, cos: torch.Tensor,
                      sin: torch.Tensor) -> None:
    """Rotate query [T, Hq, D] and key [T, Hkv, D] in place by the tables [T, D/2] ("rotate
    half": dims i and i + D/2 form one pair), in fp32, rounded once."""
    cos, sin = cos.float()[:, None, :], sin.float()[:, None, :]
    for x in (query, key):
        half = x.shape[-1] // 2
        # float() of an fp32 tensor is the tensor itself: copy before the first half is written.
        a, b = x[..., :half].float().clone(), x[..., half:].float()
        x[..., :half] = (a * cos - b * sin).to(x.dtype)
        x[..., half:] = (b * cos + a * sin).to(x.dtype)
