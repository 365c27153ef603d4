"""The attention kernels' checks against the torch references, shared by tests/kernels/.

Every batch comes from `random_paged_batch`: permuted block ids from a pool 4x larger than needed,
NaN in every slot a kernel must not read, and NaN in the output buffer before the launch, so an
unwritten output element or a stray read fails (tolerances: kernels.testing.check_against_reference).
With a sliding window, every slot before the requests' windows is NaN too (and the references run
on the poisoned pool: they must not read them either).
"""

from __future__ import annotations

import math

import torch

from raypaged.kernels.paged_decode import paged_decode_triton
from raypaged.kernels.paged_prefill import paged_prefill_triton
from raypaged.kernels.reference import paged_decode_ref, paged_prefill_ref
from raypaged.kernels.testing import (
    check_against_reference,
    new_token_kv,
    poison_before_window,
    query_start_loc,
    random_paged_batch,
)

ODD_LENS = [1, 17, 100, 513]


def check_decode(seq_lens, group, *, num_kv_heads=2, head_dim=64, block_size=16,
                 dtype=torch.float32, device="cpu", seed=0, layout="separate",
                 sliding_window=None, softcap=None, **kernel_args):
    gen = torch.Generator().manual_seed(seed)
    batch = random_paged_batch(seq_lens, num_kv_heads, head_dim, block_size, dtype, device,
                               layout=layout, generator=gen)
    if sliding_window is not None:
        poison_before_window(batch, [1] * len(seq_lens), sliding_window)
    attention = {"sliding_window": sliding_window, "softcap": softcap}
    q = torch.randn((len(seq_lens), num_kv_heads * group, head_dim), generator=gen).to(dtype).to(device)
    scale = 1 / math.sqrt(head_dim)
    out = torch.full_like(q, float("nan"))
    args = (batch.k_cache, batch.v_cache, batch.block_tables, batch.seq_lens, scale)
    result = paged_decode_triton(q, *args, out=out, **attention, **kernel_args)
    assert result is out
    check_against_reference(
        out, lambda cd: paged_decode_ref(q, *args, compute_dtype=cd, **attention), dtype
    )


def check_prefill(seq_lens, query_lens, group, *, num_kv_heads=2, head_dim=64, block_size=16,
                  dtype=torch.float32, device="cpu", seed=0, new_kv=None, fused_qkv=False,
                  sliding_window=None, softcap=None, **kernel_args):
    """new_kv "ptr"/"tma": pass this step's k/v and poison their cache slots with NaN, so the
    new tokens must come from k/v; fused_qkv: q, k, v as strided views of one [T, Hq+2Hkv, D]."""
    gen = torch.Generator().manual_seed(seed)
    batch = random_paged_batch(seq_lens, num_kv_heads, head_dim, block_size, dtype, device,
                               generator=gen)
    if sliding_window is not None:
        poison_before_window(batch, query_lens, sliding_window)
    attention = {"sliding_window": sliding_window, "softcap": softcap}
    q = torch.randn((sum(query_lens), num_kv_heads * group, head_dim), generator=gen)
    q = q.to(dtype).to(device)
    scale = 1 / math.sqrt(head_dim)
    out = torch.full_like(q, float("nan"))
    args = (batch.k_cache, batch.v_cache, batch.block_tables,
            query_start_loc(query_lens, device), batch.seq_lens, scale)
    # References first: poisoning the new tokens' slots would poison them too.
    refs = {cd: paged_prefill_ref(q, *args, compute_dtype=cd, **attention)
            for cd in {torch.float32, dtype}}
    if new_kv is not None:
        k_new, v_new = new_token_kv(batch, query_lens, poison_cache=True)
        if fused_qkv:
            qkv = torch.cat([q, k_new, v_new], dim=1)
            hq = q.shape[1]
            q, k_new, v_new = qkv[:, :hq], qkv[:, hq:hq + num_kv_heads], qkv[:, hq + num_kv_heads:]
        kernel_args.update(k_new=k_new, v_new=v_new, new_kv=new_kv)
    paged_prefill_triton(q, *args, out=out, **attention, **kernel_args)
    check_against_reference(out, refs.__getitem__, dtype)
