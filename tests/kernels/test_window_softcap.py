"""Sliding-window attention and logit soft-capping in the Triton decode and prefill kernels,
against the torch references (TRITON_INTERPRET=1 on CPU; the same checks in bf16 on the GPU).

Windows smaller than, equal to and larger than the sequences, edges inside and on block and tile
boundaries; every slot before a request's window is NaN (tests/support/kernel_checks.py), so a
kernel that reads one fails. The decode work list planned with a window starts each sequence's
items at its window's first key: the blocks before it are never read.
"""

from __future__ import annotations

import random

import pytest
import torch

from raypaged.kernels import decode_work
from raypaged.kernels.decode_work import plan, plan_decode_work
from raypaged.kernels.reference import paged_decode_ref
from tests.support.kernel_checks import check_decode, check_prefill

SMALL = {"min_chunk_tokens": 16, "tile_n": 16}  # items of a few tiles: long windows split
LENS = [1, 7, 8, 9, 16, 33, 100, 200]


@pytest.mark.parametrize("window", [1, 8, 16, 40, 1000])
@pytest.mark.parametrize("seed", range(4))
def test_window_plan_covers_exactly_each_window(seed, window):
    rng = random.Random(seed)
    lens = [rng.choice([0, 1, 5, 8, 17, 64, 300, 2000]) for _ in range(rng.randint(1, 12))]
    target = rng.choice([1, 4, 66])
    items = plan(lens, target, 16, 16, sliding_window=window)
    work = plan_decode_work(torch.tensor(lens, dtype=torch.int32), target, 16, 16,
                            sliding_window=window)
    n = len(items)
    assert work[decode_work.ITEM_SEQ, :n].tolist() == [i.seq for i in items]
    assert work[decode_work.ITEM_START, :n].tolist() == [i.start for i in items]
    assert work[decode_work.ITEM_END, :n].tolist() == [i.end for i in items]
    for seq, length in enumerate(lens):
        own = [i for i in items if i.seq == seq]
        assert own[0].start == max(0, length - window) and own[-1].end == length
        assert all(a.end == b.start for a, b in zip(own, own[1:]))


@pytest.mark.parametrize("window,target_items", [
    pytest.param(1, None, marks=pytest.mark.slow), (9, None), (16, 1),
    pytest.param(33, None, marks=pytest.mark.slow), pytest.param(1000, None, marks=pytest.mark.slow)])
def test_decode_window_against_reference(window, target_items):
    """Split items (SMALL) or whole sequences (target_items=1), GQA 4, block 8."""
    check_decode(LENS, 4, head_dim=32, block_size=8, sliding_window=window,
                 target_items=target_items, seed=window, **SMALL)


@pytest.mark.parametrize("window", [None, 12])
def test_decode_softcap_against_reference(window):
    check_decode(LENS, 1, head_dim=32, block_size=16, sliding_window=window, softcap=0.7,
                 seed=3, **SMALL)


def test_decode_reads_the_work_list_planned_with_the_window():
    from raypaged.kernels.paged_decode import plan_work

    lens = torch.tensor([300, 5, 64], dtype=torch.int32)
    work = plan_work(lens, 2, sliding_window=20, min_chunk_tokens=16, align=16)
    items = plan(lens.tolist(), 2 * 4 // 2, 16, 16, sliding_window=20)  # target: 4 SMs x 4 / 2
    firsts = {i.seq: i.start for i in reversed(items)}
    assert firsts == {0: 280, 1: 0, 2: 44}
    assert work[decode_work.ITEM_START, :len(items)].tolist() == [i.start for i in items]
    check_decode([300, 5, 64], 2, head_dim=32, block_size=16, sliding_window=20, work=work,
                 tile_n=16)


SLOW = pytest.mark.slow
PREFILL_CASES = [pytest.param(w, s, marks=() if (w, s) in {(7, "cache"), (16, "ptr")}
                              else SLOW, id=f"{w}-{s}")
                 for w in (1, 7, 16, 40, 1000) for s in ("cache", "ptr")]


@pytest.mark.parametrize("window,source", PREFILL_CASES)
def test_prefill_window_against_reference(window, source):
    """Fresh prompts, chunks after a cached prefix, single tokens; windows inside one tile
    (block_n 16), on its boundary and spanning many; GQA packed when the source allows."""
    check_prefill([40, 17, 70, 3], [40, 5, 33, 1], 2, head_dim=32, block_size=8,
                  sliding_window=window, new_kv=None if source == "cache" else source,
                  block_m=16, block_n=16, pack_gqa=source == "ptr", seed=window)


@pytest.mark.parametrize("window", [pytest.param(None, marks=SLOW), 9])
def test_prefill_softcap_against_reference(window):
    check_prefill([40, 21], [40, 6], 1, head_dim=32, block_size=16, sliding_window=window,
                  softcap=0.7, new_kv="ptr", block_m=16, block_n=16, seed=5)


def test_prefill_window_bf16_through_tma_descriptors():
    check_prefill([48, 30], [48, 10], 2, head_dim=32, block_size=16, sliding_window=10,
                  softcap=1.5, dtype=torch.bfloat16, new_kv="tma", block_m=32, block_n=16,
                  seed=6)


def test_decode_never_loads_through_a_freed_entry():
    """A sliding KV-cache group's table holds -1 where it gave a block back (the checks above
    free every block before each window). A CUDA graph's padding row (seq_len 1) may name one
    in its window: the kernel loads nothing through it (the row reads zeros) and the real rows
    are the reference's; the reference refuses a window that needs a freed block."""
    from raypaged.kernels.paged_decode import paged_decode_triton

    gen = torch.Generator().manual_seed(7)
    k_cache, v_cache = (torch.randn(6, 8, 2, 32, generator=gen) for _ in range(2))
    tables = torch.tensor([[-1, -1, -1], [-1, 4, 2], [-1, -1, -1]], dtype=torch.int32)
    lens = torch.tensor([1, 20, 1], dtype=torch.int32)
    q = torch.randn(3, 4, 32, generator=gen)
    out = paged_decode_triton(q, k_cache, v_cache, tables, lens, 0.3, sliding_window=6,
                              tile_n=16, min_chunk_tokens=16, out=torch.full_like(q, float("nan")))
    assert torch.equal(out[[0, 2]], torch.zeros_like(out[[0, 2]]))
    expected = paged_decode_ref(q[1:2], k_cache, v_cache, tables[1:2], lens[1:2], 0.3,
                                sliding_window=6)
    torch.testing.assert_close(out[1:2], expected, rtol=1e-4, atol=1e-4)
    with pytest.raises(ValueError, match="outside"):
        paged_decode_ref(q, k_cache, v_cache, tables, lens, 0.3, sliding_window=6)


def test_kernels_refuse_strided_index_rows():
    """The kernels step along a slot mapping or table row by one element: a strided one (a
    group's row of a [tokens, groups] array) is refused, by the references too."""
    from raypaged.kernels.reference import write_kv_ref

    k = torch.zeros(3, 2, 8)
    cache = torch.zeros(2, 4, 2, 8)
    slots = torch.tensor([[0, 4], [1, 5], [2, 6]])[:, 0]
    with pytest.raises(ValueError, match="contiguous"):
        write_kv_ref(k, k, cache, cache, slots)
    write_kv_ref(k, k, cache, cache, slots.contiguous())
def test_prefill_window_of_one_is_the_value_exactly_in_bf16():
    """Window 1: each query's output is its own value row, bit for bit (a softmax of one key is
    1, exact in bf16). Rows that see nothing of an edge tile before their own key must not carry
    a stand-in max into later tiles: under negative scores P would then be < 1 and rounded to
    bf16 for the P·V product, one ulp off in most elements."""
    check_prefill([40, 70], [40, 33], 2, head_dim=32, block_size=8, sliding_window=1,
                  dtype=torch.bfloat16, block_m=16, block_n=16, seed=11)


def test_references_reject_bad_windows_and_caps():
    q, cache = torch.zeros(1, 2, 8), torch.zeros(2, 4, 2, 8)
    args = (q, cache, cache, torch.zeros(1, 2, dtype=torch.int32),
            torch.ones(1, dtype=torch.int32), 1.0)
    with pytest.raises(ValueError, match="sliding_window"):
        paged_decode_ref(*args, sliding_window=0)
    with pytest.raises(ValueError, match="softcap"):
        paged_decode_ref(*args, softcap=-1.0)


# ---------------------------------------------------------------- on the GPU (bf16)

gpu = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


@pytest.mark.gpu
@gpu
@pytest.mark.parametrize("window", [1, 128, 4096, 100000])
@pytest.mark.parametrize("softcap", [None, 2.0, 50.0])  # 50 barely bends realistic scores; 2 does
def test_gpu_decode_window_softcap_bf16(window, softcap):
    lens = [1, 17, 100, 513, 4097, 32768, 33, 2048]
    for target_items in (None, 1):
        check_decode(lens, 4, num_kv_heads=8, head_dim=128, dtype=torch.bfloat16, device="cuda",
                     sliding_window=window, softcap=softcap, target_items=target_items, seed=window)


@pytest.mark.gpu
@gpu
@pytest.mark.parametrize("window", [1, 100, 512, 4096])
@pytest.mark.parametrize("softcap", [None, 2.0, 50.0])
def test_gpu_prefill_window_softcap_bf16(window, softcap):
    for pack_gqa in (False, True):
        for new_kv in (None, "ptr", "tma"):
            check_prefill([1, 17, 513, 2100, 900], [1, 17, 300, 2100, 1], 4, num_kv_heads=4,
                          head_dim=128, dtype=torch.bfloat16, device="cuda", seed=window,
                          pack_gqa=pack_gqa, new_kv=new_kv, fused_qkv=new_kv == "tma",
                          sliding_window=window, softcap=softcap)


@pytest.mark.gpu
@gpu
@pytest.mark.parametrize("window", [None, 8])
def test_gpu_fp32_at_the_tiny_gemma2_shape(window):
    """fp32 (IEEE products), head_dim 16, a strong cap (2.0) and a window of 8: the shapes and
    settings of tests/support's Gemma 2 checkpoint, whose engine test on CUDA must match
    transformers token for token."""
    check_decode([1, 2, 9, 17, 30, 65], 2, num_kv_heads=2, head_dim=16, dtype=torch.float32,
                 device="cuda", sliding_window=window, softcap=2.0, seed=3)
    check_prefill([1, 7, 30, 41, 3], [1, 7, 30, 41, 3], 2, num_kv_heads=2, head_dim=16,
                  dtype=torch.float32, device="cuda", sliding_window=window, softcap=2.0, seed=3)
