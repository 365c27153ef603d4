"""The torch references against an independent dense oracle, plus input validation and dispatch.

The oracle rebuilds each request's K/V densely (from the truth the batch was built from, not
from the cache) and runs float64 SDPA with an explicit causal mask, so it shares no code path
with the references' gather + einsum.
"""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st

from raypaged import envs
from raypaged.kernels import ops
from raypaged.kernels.reference import (
    paged_decode_ref,
    paged_prefill_ref,
    write_kv_ref,
)
from raypaged.kernels.testing import query_start_loc, random_paged_batch, relative_error_per_row


def dense_oracle(q, keys, values, query_lens, scale):
    """float64 SDPA per request; query i of request s at position len_s - q_len_s + i."""
    outs, start = [], 0
    for k, v, n in zip(keys, values, query_lens):
        qs = q[start : start + n].double().transpose(0, 1)  # [Hq, n, D]
        start += n
        group = qs.shape[0] // k.shape[1]
        kd = k.double().repeat_interleave(group, dim=1).transpose(0, 1)  # [Hq, L, D]
        vd = v.double().repeat_interleave(group, dim=1).transpose(0, 1)
        length = k.shape[0]
        query_pos = torch.arange(length - n, length)[:, None]
        mask = torch.arange(length)[None, :] <= query_pos
        o = F.scaled_dot_product_attention(qs, kd, vd, attn_mask=mask, scale=scale)
        outs.append(o.transpose(0, 1))
    return torch.cat(outs)


@settings(max_examples=25, deadline=None)
@given(
    data=st.data(),
    group=st.sampled_from([1, 4, 8]),
    block_size=st.sampled_from([8, 16, 32]),
    num_seqs=st.integers(1, 4),
)
def test_prefill_ref_matches_dense_oracle(data, group, block_size, num_seqs):
    seq_lens = data.draw(st.lists(st.integers(1, 120), min_size=num_seqs, max_size=num_seqs))
    # Any split between cached prefix and new tokens; the last request has at least one new token.
    query_lens = [data.draw(st.integers(0 if i < num_seqs - 1 else 1, n)) for i, n in enumerate(seq_lens)]
    gen = torch.Generator().manual_seed(data.draw(st.integers(0, 2**31)))
    batch = random_paged_batch(seq_lens, 2, 16, block_size, generator=gen)
    q = torch.randn((sum(query_lens), 2 * group, 16), generator=gen)
    scale = 1 / math.sqrt(16)
    out = paged_prefill_ref(
        q, batch.k_cache, batch.v_cache, batch.block_tables,
        query_start_loc(query_lens), batch.seq_lens, scale,
    )
    expected = dense_oracle(q, batch.keys, batch.values, query_lens, scale)
    assert torch.isfinite(out).all()
    assert relative_error_per_row(out, expected).max() <= 1e-5


@pytest.mark.parametrize("group", [1, 4, 8])
def test_decode_ref_matches_dense_oracle(group):
    gen = torch.Generator().manual_seed(group)
    seq_lens = [1, 17, 100, 513]
    batch = random_paged_batch(seq_lens, 2, 64, 16, generator=gen)
    q = torch.randn((4, 2 * group, 64), generator=gen)
    out = paged_decode_ref(q, batch.k_cache, batch.v_cache, batch.block_tables, batch.seq_lens, 0.125)
    expected = dense_oracle(q, batch.keys, batch.values, [1] * 4, 0.125)
    assert torch.isfinite(out).all()
    assert relative_error_per_row(out, expected).max() <= 1e-5


def test_decode_ref_gives_zeros_for_an_empty_request():
    batch = random_paged_batch([0, 5], 1, 16, 8)
    q = torch.randn(2, 1, 16)
    out = paged_decode_ref(q, batch.k_cache, batch.v_cache, batch.block_tables, batch.seq_lens, 1.0)
    assert torch.equal(out[0], torch.zeros_like(out[0])) and torch.isfinite(out[1]).all()


def test_write_kv_ref_fills_exactly_the_named_slots():
    k_cache = torch.full((6, 4, 2, 8), float("nan"))
    v_cache = k_cache.clone()
    key, value = torch.randn(5, 2, 8), torch.randn(5, 2, 8)
    slots = torch.tensor([9, -1, 0, 23, 5])
    write_kv_ref(key, value, k_cache, v_cache, slots)
    for t, slot in enumerate(slots.tolist()):
        if slot >= 0:
            assert torch.equal(k_cache[slot // 4, slot % 4], key[t])
            assert torch.equal(v_cache[slot // 4, slot % 4], value[t])
    assert int(torch.isfinite(k_cache).all(-1).all(-1).sum()) == 4


@pytest.mark.parametrize(
    "slots, message",
    [([0, 24], "capacity"), ([3, 3], "same slot"), ([0, -2], ">= -1")],
)
def test_write_kv_ref_rejects_bad_slots_without_writing(slots, message):
    k_cache = torch.zeros(6, 4, 1, 8)
    v_cache = torch.zeros(6, 4, 1, 8)
    with pytest.raises(ValueError, match=message):
        write_kv_ref(torch.ones(2, 1, 8), torch.ones(2, 1, 8), k_cache, v_cache, torch.tensor(slots))
    assert not k_cache.any() and not v_cache.any()


def test_references_reject_bad_shapes_and_tables():
    batch = random_paged_batch([10, 3], 2, 16, 8)
    args = (batch.k_cache, batch.v_cache, batch.block_tables, batch.seq_lens, 1.0)
    with pytest.raises(ValueError, match="multiple"):
        paged_decode_ref(torch.randn(2, 3, 16), *args)
    with pytest.raises(ValueError, match="head_dim"):
        paged_decode_ref(torch.randn(2, 2, 32), *args)
    with pytest.raises(ValueError, match="dtype"):
        paged_decode_ref(torch.randn(2, 2, 16, dtype=torch.float64), *args)
    with pytest.raises(ValueError, match="int32"):
        paged_decode_ref(torch.randn(2, 2, 16), batch.k_cache, batch.v_cache,
                         batch.block_tables.long(), batch.seq_lens, 1.0)
    too_long = batch.seq_lens.clone()
    too_long[0] = 1000
    with pytest.raises(ValueError, match="capacity"):
        paged_decode_ref(torch.randn(2, 2, 16), batch.k_cache, batch.v_cache,
                         batch.block_tables, too_long, 1.0)
    bad_table = batch.block_tables.clone()
    bad_table[1, 0] = batch.k_cache.shape[0]
    with pytest.raises(ValueError, match="block ids"):
        paged_decode_ref(torch.randn(2, 2, 16), batch.k_cache, batch.v_cache,
                         bad_table, batch.seq_lens, 1.0)
    with pytest.raises(ValueError, match="new tokens"):
        paged_prefill_ref(torch.randn(14, 2, 16), batch.k_cache, batch.v_cache,
                          batch.block_tables, query_start_loc([10, 4]), batch.seq_lens, 1.0)
    with pytest.raises(ValueError, match="rise"):
        paged_prefill_ref(torch.randn(5, 2, 16), batch.k_cache, batch.v_cache,
                          batch.block_tables, query_start_loc([10, -5]), batch.seq_lens, 1.0)


def test_copy_blocks_copies_every_layer_and_validates():
    k_caches = [torch.randn(5, 4, 1, 8) for _ in range(3)]
    v_caches = [torch.randn(5, 4, 1, 8) for _ in range(3)]
    before = [c.clone() for c in k_caches + v_caches]
    copies = torch.tensor([[0, 3], [2, 1]])
    ops.copy_blocks(k_caches, v_caches, copies)
    for old, new in zip(before, k_caches + v_caches):
        assert torch.equal(new[3], old[0]) and torch.equal(new[1], old[2])
        assert torch.equal(new[[0, 2, 4]], old[[0, 2, 4]])
    snapshot = [c.clone() for c in k_caches + v_caches]
    for bad in ([[0, 5]], [[0, 3], [1, 3]], [[-1, 2]]):
        with pytest.raises(ValueError):
            ops.copy_blocks(k_caches, v_caches, torch.tensor(bad))
    assert all(torch.equal(a, b) for a, b in zip(snapshot, k_caches + v_caches))


def test_backend_selection(monkeypatch):
    t = torch.zeros(1)
    monkeypatch.setattr(envs, "RAYPAGED_ATTENTION_BACKEND", None)  # as envs.py read it
    assert ops.backend_for(t) == "torch"
    monkeypatch.setattr(envs, "RAYPAGED_ATTENTION_BACKEND", "triton")
    assert ops.backend_for(t) == "triton"
    try:
        ops.set_backend("torch")
        assert ops.backend_for(t) == "torch"
        with pytest.raises(ValueError, match="unknown"):
            ops.set_backend("cuda")
    finally:
        ops.set_backend("auto")
    assert ops.backend_for(t) == "triton"
    monkeypatch.setattr(envs, "RAYPAGED_ATTENTION_BACKEND", "tvm")
    with pytest.raises(ValueError, match=ops.ENV_VAR):
        ops.backend_for(t)


def test_torch_backend_writes_into_out():
    batch = random_paged_batch([7], 1, 16, 8)
    q = torch.randn(1, 2, 16)
    out = torch.full_like(q, float("nan"))
    ops.set_backend("torch")
    try:
        result = ops.paged_decode(q, batch.k_cache, batch.v_cache, batch.block_tables,
                                  batch.seq_lens, 0.25, out=out)
        with pytest.raises(ValueError, match="out must be"):
            ops.paged_decode(q, batch.k_cache, batch.v_cache, batch.block_tables,
                             batch.seq_lens, 0.25, out=torch.empty(1, 2, 8))
    finally:
        ops.set_backend("auto")
    assert result is out and torch.isfinite(out).all()
