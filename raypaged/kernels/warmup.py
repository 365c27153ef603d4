"""Compile the attention kernels' variants before the first request needs them.

Triton compiles a kernel per combination of its compile-time parameters on first use, which on
the H200 costs around a second each. Decode compiles its kernel and merge once, its work list's
planner once per block size (a small and a large batch), the prefill kernel once per source of new
keys/values and kind of token count. A server meeting them one by one under load stalls every
running request meanwhile (the first serving rate measured on the H200 queued up to 52 requests
behind such stalls). The worker runs this once at start-up, on the real KV pool of one layer,
with the step's shapes reduced to a few tokens. What it compiles lands in Triton's disk cache too.
"""

from __future__ import annotations

import time
from collections.abc import Iterable

import torch

from .decode_work import PLAN_BLOCKS
from .kv_quant import is_fp8
from .paged_decode import paged_decode_triton
from .paged_prefill import paged_prefill_triton

# Token counts whose TMA descriptors differ in what Triton specialises on (1, a multiple of 16,
# anything else).
_PREFILL_TOKENS = (1, 16, 17)


def warm_up_attention(k_cache: torch.Tensor, v_cache: torch.Tensor, num_q_heads: int,
                      kinds: Iterable[tuple[int | None, float | None]] = ((None, None),), *,
                      query_dtype: torch.dtype | None = None) -> float:
    """Run decode once and prefill at each kind of token count, with and
    without the step's own keys/values, over block 0 of this pool (read only; outputs discarded),
    for each of the model's kinds of attention: (sliding window, soft cap), each None if off.
    query_dtype: the model's (default: the pool's, which an FP8 pool must be told).
    Returns the seconds it took."""
    start = time.perf_counter()
    dtype = query_dtype or k_cache.dtype
    for window, softcap in dict.fromkeys(kinds):
        _warm_up_kind(k_cache, v_cache, num_q_heads, window, softcap, dtype)
    if k_cache.device.type == "cuda":
        torch.cuda.synchronize(k_cache.device)
    return time.perf_counter() - start


def _warm_up_kind(k_cache: torch.Tensor, v_cache: torch.Tensor, num_q_heads: int,
                  window: int | None, softcap: float | None, dtype: torch.dtype) -> None:
    _, block_size, num_kv_heads, head_dim = k_cache.shape
    device = k_cache.device
    scale = head_dim ** -0.5
    one = torch.ones(1, dtype=torch.float32, device=device) if is_fp8(k_cache.dtype) else None
    for num_seqs in (1, PLAN_BLOCKS[0] + 1):  # the small and the large plan block
        q = torch.zeros(num_seqs, num_q_heads, head_dim, dtype=dtype, device=device)
        table = torch.zeros(num_seqs, 1, dtype=torch.int32, device=device)
        seq_lens = torch.ones(num_seqs, dtype=torch.int32, device=device)
        paged_decode_triton(q, k_cache, v_cache, table, seq_lens, scale, sliding_window=window,
                            softcap=softcap, k_scale=one, v_scale=one)
    for num_tokens in _PREFILL_TOKENS:
        q = torch.zeros(num_tokens, num_q_heads, head_dim, dtype=dtype, device=device)
        new = torch.zeros(num_tokens, num_kv_heads, head_dim, dtype=dtype, device=device)
        num_blocks = -(-num_tokens // block_size)
        table = torch.zeros(1, num_blocks, dtype=torch.int32, device=device)
        query_start_loc = torch.tensor([0, num_tokens], dtype=torch.int32, device=device)
        seq_lens = torch.tensor([num_tokens], dtype=torch.int32, device=device)
        for k_new in (new, None):
            paged_prefill_triton(q, k_cache, v_cache, table, query_start_loc, seq_lens, scale,
                                 k_new=k_new, v_new=k_new, sliding_window=window,
                                 softcap=softcap, k_scale=one, v_scale=one)
