"""The FP8 KV cache's kernels (write, paged decode, paged prefill) against the torch references,
which quantize the same way (kernels/kv_quant.py) and dequantize before any arithmetic.

Pools are `random_paged_batch`'s (permuted blocks, NaN in every slot a kernel must not read)
quantized to FP8 with per-layer scales chosen so that some values saturate; NaN stays NaN in
FP8, so a stray read still fails. Tolerances: kernels.testing.check_against_reference.
"""

from __future__ import annotations

import math

import pytest
import torch

from raypaged.kernels import ops
from raypaged.kernels.kv_quant import dequantize_kv, fp8_max, quantize_kv, resolve_kv_cache_dtype
from raypaged.kernels.paged_decode import paged_decode_triton
from raypaged.kernels.paged_prefill import paged_prefill_triton
from raypaged.kernels.reference import (
    copy_blocks_ref,
    paged_decode_ref,
    paged_prefill_ref,
    write_kv_ref,
)
from raypaged.kernels.testing import (
    PagedBatch,
    check_against_reference,
    new_token_kv,
    query_start_loc,
    random_paged_batch,
    relative_error_per_row,
)
from raypaged.kernels.write_kv import write_kv_triton

E4M3, E5M2 = torch.float8_e4m3fn, torch.float8_e5m2


def _scales(k_scale: float, v_scale: float, device="cpu") -> tuple[torch.Tensor, torch.Tensor]:
    return (torch.tensor([k_scale], dtype=torch.float32, device=device),
            torch.tensor([v_scale], dtype=torch.float32, device=device))


def fp8_batch(seq_lens, num_kv_heads, head_dim, block_size, dtype, fp8, *, seed=0,
              device="cpu", scales=(0.005, 0.004)):
    """A float batch (the truth, in `dtype`) and its FP8 pools. The default scales put
    448 · scale near 2: N(0, 1) values beyond ~2 saturate (about 5% of them)."""
    gen = torch.Generator().manual_seed(seed)
    batch = random_paged_batch(seq_lens, num_kv_heads, head_dim, block_size, dtype, device,
                               generator=gen)
    k_scale, v_scale = _scales(*scales, device=device)
    fp8_pools = PagedBatch(quantize_kv(batch.k_cache, k_scale, fp8),
                           quantize_kv(batch.v_cache, v_scale, fp8), batch.block_tables,
                           batch.seq_lens, batch.keys, batch.values)
    return batch, fp8_pools, k_scale, v_scale, gen


@pytest.mark.parametrize("fp8", [E4M3, E5M2])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_write_kv_quantizes_like_the_reference_and_saturates(fp8, dtype):
    num_tokens, heads, dim, block_size = 13, 2, 32, 8
    gen = torch.Generator().manual_seed(1)
    key = (torch.randn(num_tokens, heads, dim, generator=gen) * 3).to(dtype)
    value = torch.randn(num_tokens, heads, dim, generator=gen).to(dtype)
    key[0, 0, :4] = torch.tensor([1e6, -1e6, 3e4, -0.0])  # far beyond e4m3's range
    slots = torch.randperm(6 * block_size, generator=gen)[:num_tokens]
    slots[3] = -1  # padding: writes nothing
    k_scale, v_scale = _scales(0.01, 0.02)
    pools = []
    for write in (write_kv_triton, write_kv_ref):
        k = torch.full((6, block_size, heads, dim), float("nan")).to(fp8)
        v = torch.full_like(k, float("nan"))
        write(key, value, k, v, slots, k_scale, v_scale)
        pools.append((k, v))
    (k_tri, v_tri), (k_ref, v_ref) = pools
    assert torch.equal(k_tri.view(torch.uint8), k_ref.view(torch.uint8))
    assert torch.equal(v_tri.view(torch.uint8), v_ref.view(torch.uint8))
    written = slots[slots >= 0]
    stored = k_tri.view(-1, heads, dim)[written]
    assert torch.isfinite(stored.float()).all()
    assert stored.float().abs().max() == fp8_max(fp8)  # saturated, not inf/NaN
    # The stored values are the quantized inputs, and nothing else was touched.
    expected = quantize_kv(key[slots >= 0], k_scale, fp8)
    assert torch.equal(stored.view(torch.uint8), expected.view(torch.uint8))
    untouched = torch.ones(6 * block_size, dtype=torch.bool)
    untouched[written] = False
    assert torch.isnan(k_tri.view(-1, heads, dim)[untouched].float()).all()
    # Dequantized, the in-range values are close to the input.
    back = dequantize_kv(stored, k_scale)[1:]
    truth = key[slots >= 0][1:].float()
    in_range = truth.abs() < fp8_max(fp8) * 0.01
    tolerance = 0.07 if fp8 == E4M3 else 0.13  # 3 (2) mantissa bits: half an ulp
    assert ((back - truth).abs()[in_range] <= tolerance * truth.abs()[in_range] + 1e-4).all()


def test_ops_write_kv_needs_the_scales_of_an_fp8_pool():
    key = torch.zeros(2, 1, 8)
    pool = torch.zeros(2, 4, 1, 8, dtype=E4M3)
    with pytest.raises(ValueError, match="needs k_scale"):
        ops.write_kv(key, key, pool, pool.clone(), torch.tensor([0, 1]))
    with pytest.raises(ValueError, match="for FP8 KV caches"):
        ops.write_kv(key, key, torch.zeros(2, 4, 1, 8), torch.zeros(2, 4, 1, 8),
                     torch.tensor([0, 1]), k_scale=torch.ones(1), v_scale=torch.ones(1))


@pytest.mark.parametrize("fp8, dtype, group, target_items", [
    (E4M3, torch.float32, 4, None),  # long sequences split into many work items
    (E4M3, torch.bfloat16, 8, 1),  # every sequence whole
    (E5M2, torch.float16, 1, None),
])
def test_decode_reads_fp8_like_the_reference(fp8, dtype, group, target_items):
    seq_lens = [1, 17, 300, 45]
    _, batch, k_scale, v_scale, gen = fp8_batch(seq_lens, 2, 64, 16, dtype, fp8)
    q = torch.randn(len(seq_lens), 2 * group, 64, generator=gen).to(dtype)
    args = (batch.k_cache, batch.v_cache, batch.block_tables, batch.seq_lens, 1 / math.sqrt(64))
    scales = {"k_scale": k_scale, "v_scale": v_scale}
    out = torch.full_like(q, float("nan"))
    paged_decode_triton(q, *args, out=out, target_items=target_items, min_chunk_tokens=16,
                        tile_n=16, **scales)
    check_against_reference(out, lambda cd: paged_decode_ref(q, *args, compute_dtype=cd, **scales),
                            dtype)


@pytest.mark.parametrize("fp8, dtype, new_kv", [
    (E4M3, torch.float32, None),  # every key through the block table
    (E4M3, torch.float32, "ptr"),
    (E4M3, torch.bfloat16, "tma"),
    (E5M2, torch.float16, "ptr"),
])
def test_prefill_reads_fp8_like_the_reference(fp8, dtype, new_kv):
    # A fresh prefill, a chunk after a cached prefix, one token, none, a long prefix hit.
    seq_lens, query_lens = [17, 60, 9, 130], [17, 23, 0, 20]
    _, batch, k_scale, v_scale, gen = fp8_batch(seq_lens, 2, 64, 16, dtype, fp8, seed=2)
    q = torch.randn(sum(query_lens), 8, 64, generator=gen).to(dtype)
    args = (batch.k_cache, batch.v_cache, batch.block_tables, query_start_loc(query_lens),
            batch.seq_lens, 1 / math.sqrt(64))
    scales = {"k_scale": k_scale, "v_scale": v_scale}
    refs = {cd: paged_prefill_ref(q, *args, compute_dtype=cd, **scales)
            for cd in {torch.float32, dtype}}
    kernel_args: dict = {}
    if new_kv is not None:
        # The new tokens' slots become NaN: the kernel must take them from k/v (in q's dtype)
        # and quantize them in the tile exactly as the pool holds them.
        k_new, v_new = new_token_kv(batch, query_lens, poison_cache=True)
        kernel_args.update(k_new=k_new, v_new=v_new, new_kv=new_kv)
    out = torch.full_like(q, float("nan"))
    paged_prefill_triton(q, *args, out=out, **scales, **kernel_args)
    check_against_reference(out, refs.__getitem__, dtype)


def test_fp8_attention_stays_close_to_float_attention():
    # Scales from the values' own maximum (nothing saturates): what a calibrated checkpoint has.
    seq_lens = [64, 200]
    gen = torch.Generator().manual_seed(3)
    batch = random_paged_batch(seq_lens, 2, 64, 16, torch.float32, generator=gen)
    amax = max(float(torch.cat(batch.keys).abs().max()), float(torch.cat(batch.values).abs().max()))
    _, fp8, k_scale, v_scale, _ = fp8_batch(seq_lens, 2, 64, 16, torch.float32, E4M3, seed=3,
                                            scales=(amax / 448, amax / 448))
    q = torch.randn(2, 8, 64, generator=gen)
    exact = paged_decode_ref(q, batch.k_cache, batch.v_cache, batch.block_tables, batch.seq_lens, 0.125)
    quantized = paged_decode_triton(q, fp8.k_cache, fp8.v_cache, fp8.block_tables, fp8.seq_lens,
                                    0.125, k_scale=k_scale, v_scale=v_scale)
    assert relative_error_per_row(quantized, exact).max() < 0.08


def test_copy_blocks_copies_fp8_pools_exactly():
    pool = quantize_kv(torch.randn(4, 8, 1, 16), torch.tensor([0.01]), E4M3)
    other = pool.clone()
    copy_blocks_ref([pool], [other], torch.tensor([[0, 3], [1, 2]]))
    assert torch.equal(pool[3].view(torch.uint8), pool[0].view(torch.uint8))
    assert torch.equal(other[2].view(torch.uint8), other[1].view(torch.uint8))


def test_kv_cache_dtype_names():
    assert resolve_kv_cache_dtype("auto", torch.bfloat16) == torch.bfloat16
    assert resolve_kv_cache_dtype("fp8", torch.float32) == E4M3
    assert resolve_kv_cache_dtype("fp8_e4m3", torch.float16) == E4M3
    assert resolve_kv_cache_dtype("fp8_e5m2", torch.bfloat16) == E5M2
    with pytest.raises(ValueError, match="unknown kv_cache_dtype"):
        resolve_kv_cache_dtype("int8", torch.float32)


def _poison_new_slots(batch: PagedBatch, query_lens: list[int]) -> None:
    """NaN (e4m3's 0x7F) into the new tokens' slots, written as bytes (indexed FP8 stores are
    not implemented on every device)."""
    for s, q_len in enumerate(query_lens):
        length = int(batch.seq_lens[s])
        positions = torch.arange(length - q_len, length, device=batch.k_cache.device)
        blocks = batch.block_tables[s, positions // batch.block_size].long()
        for pool in (batch.k_cache, batch.v_cache):
            pool.view(torch.uint8)[blocks, positions % batch.block_size] = 0x7F


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("new_kv", ["cache", "ptr", "tma"])
def test_fp8_kernels_on_cuda(new_kv):
    """Write, decode and prefill on an FP8 pool on the GPU, bf16 queries, the default configs."""
    dev = "cuda"
    seq_lens, query_lens = [1, 300, 1000, 64], [1, 100, 257, 64]
    _, batch, k_scale, v_scale, gen = fp8_batch(seq_lens, 8, 128, 16, torch.bfloat16, E4M3,
                                                device=dev)
    scales = {"k_scale": k_scale, "v_scale": v_scale}
    q = torch.randn(sum(query_lens), 32, 128, generator=gen).to(torch.bfloat16).to(dev)
    args = (batch.k_cache, batch.v_cache, batch.block_tables, query_start_loc(query_lens, dev),
            batch.seq_lens, 128 ** -0.5)
    refs = {cd: paged_prefill_ref(q, *args, compute_dtype=cd, **scales)
            for cd in (torch.float32, torch.bfloat16)}
    # Decode first: the prefill's new-token slots are poisoned below, and decode reads the pool.
    dq = torch.randn(len(seq_lens), 32, 128, generator=gen).to(torch.bfloat16).to(dev)
    dargs = (batch.k_cache, batch.v_cache, batch.block_tables, batch.seq_lens, 128 ** -0.5)
    dout = paged_decode_triton(dq, *dargs, **scales)
    check_against_reference(dout, lambda cd: paged_decode_ref(dq, *dargs, compute_dtype=cd, **scales),
                            torch.bfloat16)
    k_new, v_new = new_token_kv(batch, query_lens)
    if new_kv != "cache":
        _poison_new_slots(batch, query_lens)
    out = paged_prefill_triton(q, *args, k_new=k_new, v_new=v_new, new_kv=new_kv, **scales)
    check_against_reference(out, refs.__getitem__, torch.bfloat16)
    key = (torch.randn(64, 8, 128, generator=gen) * 10).to(torch.bfloat16).to(dev)
    slots = torch.arange(64, device=dev)
    pools = [torch.zeros(8, 16, 8, 128, dtype=E4M3, device=dev) for _ in range(4)]
    write_kv_triton(key, key, pools[0], pools[1], slots, *_scales(0.01, 0.01, dev))
    write_kv_ref(key, key, pools[2], pools[3], slots, *_scales(0.01, 0.01, dev))
    assert torch.equal(pools[0].view(torch.uint8), pools[2].view(torch.uint8))
    assert torch.isfinite(pools[0].float()).all()
