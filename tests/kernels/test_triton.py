"""Triton prefill and KV-write kernels against the torch references (themselves checked in
test_reference.py); decode is test_decode.py.

On CPU the kernels run under TRITON_INTERPRET=1 (tests/conftest.py); tests marked `gpu` repeat
the checks on CUDA in bf16 at larger sizes (scripts/gpu.sh tests). Every batch comes from
`random_paged_batch` (tests/support/kernel_checks.py says what it poisons).

Tolerances (kernels.testing.check_against_reference): fp32 ≤ 1e-4 relative per (token, head) row
against the fp32 reference; fp16/bf16 within 2x (+1e-3) of the error that the same reference
computed in that dtype makes.
"""

from __future__ import annotations

import pytest
import torch

from raypaged.kernels import ops
from raypaged.kernels.paged_decode import paged_decode_triton
from raypaged.kernels.paged_prefill import CUDA_DEFAULT, VARIANTS, paged_prefill_triton
from raypaged.kernels.reference import paged_decode_ref, paged_prefill_ref, write_kv_ref
from raypaged.kernels.testing import (
    check_against_reference,
    new_token_kv,
    query_start_loc,
    random_paged_batch,
    relative_error_per_row,
)
from raypaged.kernels.write_kv import write_kv_triton
from tests.support.kernel_checks import ODD_LENS, check_decode, check_prefill

# ---------------------------------------------------------------- prefill


@pytest.mark.parametrize("group, pack_gqa", [(1, False), (4, False), (8, False), (4, True), (8, True)])
def test_prefill_fp32_fresh_chunked_and_prefix_hit(group, pack_gqa):
    # Request 0: fresh prefill. 1: a chunk after a cached prefix. 2: one token (decode-like).
    # 3: nothing new this step. 4: long prefix hit (many KV tiles, a ragged last block), 100 new.
    seq_lens = [17, 100, 40, 9, 257]
    query_lens = [17, 37, 1, 0, 100]
    check_prefill(seq_lens, query_lens, group, seed=group, pack_gqa=pack_gqa)


@pytest.mark.parametrize("block_m, block_n, block_size", [(16, 16, 32), (16, 32, 8), (32, 16, 16)])
def test_prefill_tile_shapes_against_page_size(block_m, block_n, block_size):
    check_prefill([1, 45, 70], [1, 45, 33], 2, block_size=block_size,
                  block_m=block_m, block_n=block_n)


@pytest.mark.parametrize("dtype, block_size", [(torch.bfloat16, 16), (torch.float16, 8)])
def test_prefill_half_precision(dtype, block_size):
    check_prefill([100, 257], [100, 64], 4, head_dim=128, dtype=dtype, block_size=block_size)


CHUNKED_MIX = ([17, 100, 40, 9, 257], [17, 37, 1, 0, 100])  # fresh, chunk, 1 token, none, hit


@pytest.mark.parametrize("group, pack_gqa", [(1, False), (4, False), (8, False), (8, True)])
def test_prefill_new_tokens_from_step_kv_fp32(group, pack_gqa):
    # fp32 cannot use TMA (tf32 boxes): "tma" falls back to plain pointers.
    check_prefill(*CHUNKED_MIX, group, seed=group, pack_gqa=pack_gqa, new_kv="tma")


@pytest.mark.parametrize(
    "dtype, head_dim, block_size, group, new_kv, fused",
    [(torch.bfloat16, 128, 16, 4, "tma", True), (torch.float16, 64, 8, 8, "tma", False),
     (torch.bfloat16, 64, 32, 1, "ptr", True), (torch.float16, 128, 16, 4, "ptr", False)],
)
def test_prefill_new_tokens_from_step_kv_half(dtype, head_dim, block_size, group, new_kv, fused):
    check_prefill(*CHUNKED_MIX, group, head_dim=head_dim, block_size=block_size, dtype=dtype,
                  new_kv=new_kv, fused_qkv=fused)


@pytest.mark.parametrize("block_m, block_n, block_size", [(16, 16, 32), (16, 32, 8), (32, 16, 16)])
@pytest.mark.parametrize("new_kv", ["ptr", "tma"])
def test_prefill_step_kv_tile_shapes(block_m, block_n, block_size, new_kv):
    # block_n > block_m: the diagonal spans tiles that start before the program's first token.
    check_prefill([1, 45, 70], [1, 45, 33], 2, block_size=block_size, dtype=torch.bfloat16,
                  block_m=block_m, block_n=block_n, new_kv=new_kv)


# The engine runs CUDA_DEFAULT (and the fp32 / CPU configs the tests above cover); the other
# variants are candidates that benchmarks/bench_prefill_variants.py times: they run with -m slow.
@pytest.mark.parametrize("variant", [v if v == CUDA_DEFAULT else pytest.param(v, marks=pytest.mark.slow)
                                     for v in sorted(VARIANTS)])
def test_prefill_every_tuned_variant(variant):
    # What the prefill-variants benchmark times, at interpreter size: a fresh prefill and a prefix hit.
    check_prefill([300, 200], [300, 70], 4, head_dim=128, dtype=torch.bfloat16, new_kv="tma",
                  fused_qkv=True, variant=variant)


@pytest.mark.parametrize("new_kv", ["ptr", "tma"])
def test_prefill_step_kv_padding_rows_past_the_last_request_are_never_used(new_kv):
    # Padded steps (CUDA graph buckets) carry rows past query_start_loc[-1]; with TMA the
    # diagonal tile of the last request reads them: NaN there must not leak into any output.
    qlens, pad = [30, 21], 11
    batch = random_paged_batch([50, 21], 2, 64, 16, torch.bfloat16)
    q = torch.randn(51 + pad, 4, 64).to(torch.bfloat16)
    args = (batch.k_cache, batch.v_cache, batch.block_tables, query_start_loc(qlens),
            batch.seq_lens, 0.125)
    k_new, v_new = (torch.cat([t, torch.full((pad, 2, 64), float("nan"), dtype=t.dtype)])
                    for t in new_token_kv(batch, qlens))
    out = torch.full_like(q, float("nan"))
    paged_prefill_triton(q, *args, out=out, k_new=k_new, v_new=v_new, new_kv=new_kv,
                         block_m=32, block_n=32)
    check_against_reference(out[:51], lambda cd: paged_prefill_ref(q[:51], *args, compute_dtype=cd),
                            torch.bfloat16)
    assert out[51:].isnan().all()  # padding rows are not written


def test_prefill_without_step_kv_or_unusable_step_kv_reads_the_cache():
    batch = random_paged_batch([40], 2, 64, 16)
    q = torch.randn(40, 4, 64)
    args = (batch.k_cache, batch.v_cache, batch.block_tables, query_start_loc([40]),
            batch.seq_lens, 0.125)
    expected = paged_prefill_ref(q, *args)
    k_new, v_new = new_token_kv(batch, [40])
    for kv in [(None, None), (k_new.half(), v_new.half())]:  # dtype differs from the cache
        out = paged_prefill_triton(q, *args, k_new=kv[0], v_new=kv[1], new_kv="tma")
        assert relative_error_per_row(out, expected).max() <= 1e-4
    with pytest.raises(ValueError, match="k_new/v_new must be"):
        paged_prefill_triton(q, *args, k_new=k_new[:3], v_new=v_new[:3])


# ---------------------------------------------------------------- KV write


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_write_kv_matches_reference(dtype):
    gen = torch.Generator().manual_seed(3)
    pools = [torch.full((40, 16, 2, 64), float("nan"), dtype=dtype) for _ in range(4)]
    key = torch.randn((30, 2, 64), generator=gen).to(dtype)
    value = torch.randn((30, 2, 64), generator=gen).to(dtype)
    slots = torch.randperm(40 * 16, generator=gen)[:30]
    slots[::7] = -1  # padding tokens
    write_kv_triton(key, value, pools[0], pools[1], slots)
    write_kv_ref(key, value, pools[2], pools[3], slots)
    assert torch.equal(pools[0].isnan(), pools[2].isnan())
    assert torch.equal(pools[0].nan_to_num(), pools[2].nan_to_num())
    assert torch.equal(pools[1].nan_to_num(), pools[3].nan_to_num())


def test_write_kv_never_writes_outside_the_pool():
    pools = [torch.zeros(4, 8, 1, 64) for _ in range(2)]
    write_kv_triton(torch.ones(2, 1, 64), torch.ones(2, 1, 64), *pools, torch.tensor([32, 5]))
    assert pools[0][0, 5].eq(1).all() and int(pools[0].count_nonzero()) == 64


# ---------------------------------------------------------------- int64 offsets


@pytest.fixture(scope="module")
def huge_pool_batch():
    """Block ids past 2^21 in a pool whose block stride is 1024 elements: offsets > 2^31.

    K and V share one interleaved buffer (fp16, block 8, 1 KV head, head_dim 64): 4.3 GB of
    address space, of which the OS backs only the pages the test touches.
    """
    block_stride = 8 * 2 * 1 * 64
    num_blocks = 2**31 // block_stride + 64
    batch = random_paged_batch([100, 1, 33], 1, 64, 8, torch.float16, num_blocks=num_blocks,
                               high_block_ids=True, layout="interleaved",
                               generator=torch.Generator().manual_seed(7))
    offsets = batch.block_tables.long() * batch.k_cache.stride(0)
    assert int(offsets.max()) > 2**31 and int(offsets.min()) < 2**31
    return batch


def test_decode_and_prefill_offsets_past_int32(huge_pool_batch):
    b = huge_pool_batch
    q = torch.randn(3, 4, 64, dtype=torch.float16)
    args = (b.k_cache, b.v_cache, b.block_tables, b.seq_lens, 0.125)
    for target_items in (1, None):
        out = paged_decode_triton(q, *args, target_items=target_items, min_chunk_tokens=16)
        check_against_reference(out, lambda cd: paged_decode_ref(q, *args, compute_dtype=cd),
                                 torch.float16)
    qp = torch.randn(134, 4, 64, dtype=torch.float16)
    pargs = (b.k_cache, b.v_cache, b.block_tables, query_start_loc([100, 1, 33]), b.seq_lens, 0.125)
    out = paged_prefill_triton(qp, *pargs)
    check_against_reference(out, lambda cd: paged_prefill_ref(qp, *pargs, compute_dtype=cd),
                             torch.float16)
    # A prefix hit: prefix through the table (offsets past int32), new tokens from k/v.
    qlens = [40, 1, 10]
    qe = torch.randn(51, 4, 64, dtype=torch.float16)
    eargs = (*pargs[:3], query_start_loc(qlens), b.seq_lens, 0.125)
    k_new, v_new = new_token_kv(b, qlens)
    out = paged_prefill_triton(qe, *eargs, k_new=k_new, v_new=v_new, new_kv="tma")
    check_against_reference(out, lambda cd: paged_prefill_ref(qe, *eargs, compute_dtype=cd),
                             torch.float16)


def test_write_kv_offsets_past_int32(huge_pool_batch):
    b = huge_pool_batch
    top = b.k_cache.shape[0] - 1
    slots = torch.tensor([top * 8 + 7, -1, (top - 3) * 8])
    key = torch.randn(3, 1, 64, dtype=torch.float16)
    value = torch.randn(3, 1, 64, dtype=torch.float16)
    write_kv_triton(key, value, b.k_cache, b.v_cache, slots)
    assert torch.equal(b.k_cache[top, 7], key[0]) and torch.equal(b.v_cache[top - 3, 0], value[2])


# ---------------------------------------------------------------- dispatch and validation


def test_ops_dispatch_to_triton():
    batch = random_paged_batch([12, 30], 2, 64, 16)
    q = torch.randn(2, 4, 64)
    args = (batch.k_cache, batch.v_cache, batch.block_tables, batch.seq_lens, 0.125)
    ops.set_backend("triton")
    try:
        out = ops.paged_decode(q, *args)
        qp = torch.randn(42, 4, 64)
        pargs = (batch.k_cache, batch.v_cache, batch.block_tables, query_start_loc([12, 30]),
                 batch.seq_lens, 0.125)
        prefill = ops.paged_prefill(qp, *pargs)
        k_new, v_new = new_token_kv(batch, [12, 30])
        from_step_kv = ops.paged_prefill(qp, *pargs, k_new=k_new, v_new=v_new)
    finally:
        ops.set_backend("auto")
    assert relative_error_per_row(out, paged_decode_ref(q, *args)).max() <= 1e-4
    assert relative_error_per_row(prefill, paged_prefill_ref(qp, *pargs)).max() <= 1e-4
    assert relative_error_per_row(from_step_kv, paged_prefill_ref(qp, *pargs)).max() <= 1e-4


def test_launchers_reject_bad_input_before_launching():
    batch = random_paged_batch([12], 2, 64, 16)
    args = (batch.k_cache, batch.v_cache, batch.block_tables, batch.seq_lens, 0.125)
    with pytest.raises(ValueError, match="multiple"):
        paged_decode_triton(torch.randn(1, 3, 64), *args)
    with pytest.raises(ValueError, match=">= 1"):
        paged_decode_triton(torch.randn(1, 4, 64), *args, target_items=0)
    out = torch.full((1, 4, 32), float("nan"))
    with pytest.raises(ValueError, match="out must be"):
        paged_decode_triton(torch.randn(1, 4, 64), *args, out=out)
    with pytest.raises(ValueError, match="query_start_loc"):
        paged_prefill_triton(torch.randn(12, 4, 64), batch.k_cache, batch.v_cache,
                             batch.block_tables, query_start_loc([6, 6]), batch.seq_lens, 0.1)
    with pytest.raises(ValueError, match="slot_mapping"):
        write_kv_triton(torch.randn(2, 2, 64), torch.randn(2, 2, 64), batch.k_cache,
                        batch.v_cache, torch.tensor([0]))
    assert out.isnan().all()


# ---------------------------------------------------------------- exhaustive grid (slow)


@pytest.mark.slow
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("head_dim", [64, 128])
@pytest.mark.parametrize("block_size", [8, 16, 32])
@pytest.mark.parametrize("group", [1, 4, 8])
def test_exhaustive_grid(dtype, head_dim, block_size, group):
    seed = head_dim + block_size + group
    for target_items in (1, 4, None):
        check_decode(ODD_LENS, group, head_dim=head_dim, block_size=block_size, dtype=dtype,
                     target_items=target_items, min_chunk_tokens=32, seed=seed)
    for new_kv in (None, "tma"):
        check_prefill([513, 100, 17, 1], [200, 100, 5, 1], group, head_dim=head_dim,
                      block_size=block_size, dtype=dtype, seed=seed, new_kv=new_kv)


# ---------------------------------------------------------------- on the GPU (bf16)

gpu = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


@pytest.mark.gpu
@gpu
@pytest.mark.parametrize("group", [1, 4, 8])
@pytest.mark.parametrize("head_dim", [64, 128, 256])
def test_gpu_prefill_bf16(group, head_dim):
    for pack_gqa in (False, True):
        for new_kv in (None, "ptr", "tma"):
            check_prefill([1, 17, 513, 2100, 900], [1, 17, 300, 2100, 1], group, num_kv_heads=4,
                          head_dim=head_dim, dtype=torch.bfloat16, device="cuda", seed=group,
                          pack_gqa=pack_gqa, new_kv=new_kv, fused_qkv=new_kv == "tma")


@pytest.mark.gpu
@gpu
def test_gpu_write_kv_and_int64_offsets():
    block_stride = 16 * 8 * 128
    num_blocks = 2**31 // block_stride + 256
    batch = random_paged_batch([700, 33, 1], 8, 128, 16, torch.bfloat16, "cuda",
                               num_blocks=num_blocks, high_block_ids=True)
    assert int(batch.block_tables.long().max()) * block_stride > 2**31
    q = torch.randn(3, 32, 128, dtype=torch.bfloat16, device="cuda")
    args = (batch.k_cache, batch.v_cache, batch.block_tables, batch.seq_lens, 128**-0.5)
    for target_items in (1, None):
        out = paged_decode_triton(q, *args, target_items=target_items)
        check_against_reference(out, lambda cd: paged_decode_ref(q, *args, compute_dtype=cd),
                                 torch.bfloat16)
    slots = batch.block_tables[0, :3].long() * 16 + 5
    key = torch.randn(3, 8, 128, dtype=torch.bfloat16, device="cuda")
    write_kv_triton(key, key, batch.k_cache, batch.v_cache, slots)
    assert torch.equal(batch.k_cache[batch.block_tables[0, :3].long(), 5], key)
