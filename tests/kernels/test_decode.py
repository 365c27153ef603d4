"""The Triton paged decode kernel and its work list (decode_work.py): the list computed on the
device against the host's `plan`, the kernel against the torch reference.

The kernel is checked on mixed-length batches cut into many items (small min_chunk_tokens and
tiles, so a few hundred tokens already make dozens of items under the interpreter), on batches
where every sequence is one item (target_items=1), and across the plan's corners: empty
sequences, more items per sequence than one merge load takes, the item-count bound met exactly.
"""

from __future__ import annotations

import math
import random

import pytest
import torch

from raypaged.kernels import decode_work
from raypaged.kernels.decode_work import max_items, max_merges, plan, plan_decode_work
from raypaged.kernels.paged_decode import MERGE_BLOCK, default_target_items, paged_decode_triton, plan_work
from raypaged.kernels.reference import paged_decode_ref
from raypaged.kernels.testing import check_against_reference, random_paged_batch, relative_error_per_row
from tests.support.kernel_checks import ODD_LENS, check_decode

SMALL = {"min_chunk_tokens": 16, "tile_n": 16}  # items of a few tiles: many per sequence


def mixed_lengths(rng: random.Random, num_seqs: int, longest: int) -> list[int]:
    """Lognormal lengths with a long tail, one sequence of `longest`, an empty one now and then."""
    lens = [min(longest, int(rng.lognormvariate(math.log(40), 1.0))) for _ in range(num_seqs - 1)]
    lens.insert(rng.randrange(num_seqs), longest)
    return lens


# ---------------------------------------------------------------- the plan (host mirror)


@pytest.mark.parametrize("seed", range(20))
def test_plan_covers_every_token_once_within_the_grid_bound(seed):
    rng = random.Random(seed)
    lens = mixed_lengths(rng, rng.randint(1, 40), rng.choice([1, 300, 5000]))
    target, min_chunk, tile = rng.choice([1, 3, 16, 66, 500]), rng.choice([1, 16, 128]), 16
    items = plan(lens, target, min_chunk, tile)
    assert len(items) <= max_items(len(lens), target)
    assert sum(len([i for i in items if i.seq == s]) > 1 for s in range(len(lens))) <= max_merges(len(lens), target)
    chunk = max(-(-sum(lens) // target), min_chunk)
    for seq, length in enumerate(lens):
        own = [i for i in items if i.seq == seq]
        assert own[0].start == 0 and own[-1].end == length  # in order, no gap, no overlap
        assert all(a.end == b.start for a, b in zip(own, own[1:]))
        if len(own) > 1:  # a split sequence's items are balanced: under 2 chunks (plus a tile)
            assert max(i.end - i.start for i in own) < 2 * chunk + tile
    order = [i.seq for i in items]
    runs = [s for k, s in enumerate(order) if k == 0 or order[k - 1] != s]
    assert len(runs) == len(set(runs)) == len(lens)  # each sequence's items together
    # Largest first: every sequence of >= chunk tokens before any shorter, >= chunk / 4 next.
    classes = [sum(lens[s] < t for t in (chunk, chunk // 4)) for s in runs]
    assert classes == sorted(classes)


def test_plan_splits_a_lone_long_sequence_and_leaves_a_uniform_batch_whole():
    assert len(plan([32768], 66, 128, 64)) == 64  # batch 1 fills the card
    assert len(plan([4096] * 64, 66, 128, 64)) == 64  # 64 x 8 heads already do: one item each
    assert len(plan([200], 66, 128, 64)) == 1  # too short to be worth a split
    mixed = plan([500] * 63 + [32768], 66, 128, 64)
    assert sum(i.seq == 63 for i in mixed) >= 16  # the long one is shared out


@pytest.mark.parametrize("seed", range(6))
def test_the_device_work_list_is_the_host_plan(seed):
    rng = random.Random(100 + seed)
    lens = mixed_lengths(rng, rng.randint(1, 30), rng.choice([1, 400, 3000]))
    if seed == 1:
        lens[0] = 0
    target = [1, 5, 40, 200, 200, 40][seed]  # 200: a list wider than the small plan block
    min_chunk, align = rng.choice([1, 16, 128]), rng.choice([16, 64])
    work = plan_decode_work(torch.tensor(lens, dtype=torch.int32), target, min_chunk, align)
    expected = plan(lens, target, min_chunk, align)
    n = len(expected)
    assert work[decode_work.ITEM_SEQ, :n].tolist() == [i.seq for i in expected]
    assert work[decode_work.ITEM_START, :n].tolist() == [i.start for i in expected]
    assert work[decode_work.ITEM_END, :n].tolist() == [i.end for i in expected]
    counts = [sum(i.seq == s for i in expected) for s in range(len(lens))]
    assert work[decode_work.ITEM_COUNT, :n].tolist() == [counts[i.seq] for i in expected]
    assert work[decode_work.ITEM_SEQ, n:].eq(-1).all()  # the grid's spare programs exit
    split = [s for s, c in enumerate(counts) if c > 1]
    assert len(split) <= max_merges(len(lens), target)
    assert work[decode_work.MERGES, :len(split)].tolist() == split
    assert work[decode_work.MERGES, len(split):].eq(-1).all()
    firsts = [next(k for k, i in enumerate(expected) if i.seq == s) for s in range(len(lens))]
    assert work[decode_work.SEQ_FIRST, :len(lens)].tolist() == firsts
    assert work[decode_work.SEQ_COUNT, :len(lens)].tolist() == counts
    runs = [s for k, s in enumerate(i.seq for i in expected) if k == 0 or expected[k - 1].seq != s]
    assert work[decode_work.SEQ_ORDER, :len(lens)].tolist() == runs


def test_a_batch_longer_than_one_plan_block_is_listed_in_order():
    lens = [1 + (7 * s) % 50 for s in range(1500)]  # more sequences than the plan's 1,024 a pass
    lens[1200] = 90000
    work = plan_decode_work(torch.tensor(lens, dtype=torch.int32), 66, 128, 64)
    expected = plan(lens, 66, 128, 64)
    assert work[decode_work.ITEM_SEQ, :len(expected)].tolist() == [i.seq for i in expected]
    assert work[decode_work.ITEM_START, :len(expected)].tolist() == [i.start for i in expected]
    assert work[decode_work.MERGES, :2].tolist() == [1200, -1]


def test_default_target_fills_the_card():
    assert default_target_items(8, 132) == 66
    assert default_target_items(64, 4) == 1


# ---------------------------------------------------------------- the kernel


@pytest.mark.parametrize("group", [1, 4, 8])
@pytest.mark.parametrize("target_items", [1, None])
def test_decode_fp32_gqa_split_and_whole(group, target_items):
    check_decode(ODD_LENS, group, target_items=target_items, seed=group * 10 + (target_items or 0))


@pytest.mark.parametrize("seed", range(4))
def test_decode_random_mixed_batches_cut_into_many_items(seed):
    rng = random.Random(seed)
    lens = mixed_lengths(rng, rng.randint(2, 12), rng.choice([300, 700]))
    if seed == 0:
        lens[0] = 0
    target = rng.choice([8, 40])
    items = plan(lens, target, SMALL["min_chunk_tokens"], SMALL["tile_n"])
    assert len(items) > len(lens)  # the merge runs
    check_decode(lens, rng.choice([1, 4]), block_size=rng.choice([8, 16]), target_items=target,
                 seed=seed, **SMALL)


def test_decode_more_items_than_one_merge_load_and_the_grid_bound_met():
    # 4,000 tokens into items of 32: 125 for one sequence, more than a merge load takes.
    lens, target = [5, 4000], 200
    assert len([i for i in plan(lens, target, 16, 16) if i.seq == 1]) > MERGE_BLOCK
    check_decode(lens, 2, block_size=32, target_items=target, **SMALL)
    # Empty sequences beside one that holds all the tokens: one short of the grid's bound.
    lens = [0, 0, 192, 0, 0, 0]
    assert len(plan(lens, 6, 16, 16)) == max_items(6, 6) - 1
    check_decode(lens, 4, target_items=6, **SMALL)


@pytest.mark.parametrize(
    "dtype, block_size, head_dim",
    [(torch.bfloat16, 8, 128), (torch.float16, 32, 128), (torch.bfloat16, 16, 64)],
)
def test_decode_half_precision_with_the_default_plan(dtype, block_size, head_dim):
    check_decode(ODD_LENS[1:], 4, dtype=dtype, block_size=block_size, head_dim=head_dim)


@pytest.mark.parametrize("layout", ["head_major", "interleaved"])
def test_decode_follows_cache_strides(layout):
    check_decode([33, 70], 4, layout=layout, target_items=4, **SMALL)


def test_decode_empty_request_gives_zeros_split_or_whole():
    for target_items in (1, 8):
        batch = random_paged_batch([0, 9, 300], 1, 64, 8)
        q = torch.randn(3, 4, 64)
        out = paged_decode_triton(q, batch.k_cache, batch.v_cache, batch.block_tables,
                                  batch.seq_lens, 0.1, target_items=target_items, **SMALL)
        assert torch.equal(out[0], torch.zeros_like(out[0]))
        assert torch.isfinite(out[1:]).all()


def test_one_work_list_serves_every_layer_of_a_step():
    # plan_work once, then launches with other queries and pools (the layers) over the same list.
    lens = [300, 40, 0, 129]
    gen = torch.Generator().manual_seed(5)
    work = None
    for layer in range(2):
        batch = random_paged_batch(lens, 2, 64, 16, generator=gen)
        if work is None:
            work = plan_work(batch.seq_lens, 2, target_items=8, min_chunk_tokens=16, align=16)
        q = torch.randn(4, 4, 64, generator=gen)
        args = (batch.k_cache, batch.v_cache, batch.block_tables, batch.seq_lens, 0.125)
        out = paged_decode_triton(q, *args, work=work, tile_n=16)
        assert relative_error_per_row(out, paged_decode_ref(q, *args)).max() <= 1e-4, layer


def test_a_work_list_of_the_wrong_shape_is_refused():
    batch = random_paged_batch([30, 3], 2, 64, 16)
    args = (batch.k_cache, batch.v_cache, batch.block_tables, batch.seq_lens, 0.125)
    with pytest.raises(ValueError, match="work must be"):
        paged_decode_triton(torch.randn(2, 4, 64), *args, work=torch.zeros(3, 9, dtype=torch.int32))
    with pytest.raises(ValueError, match="buffer must be"):
        plan_decode_work(batch.seq_lens, 4, 16, 16, out=torch.zeros(8, 5, dtype=torch.int32))


def test_decode_reads_strided_queries_and_writes_strided_out():
    batch = random_paged_batch([200, 3], 2, 64, 8)
    qkv = torch.randn(2, 3, 8, 64)  # q is a non-contiguous slice, as from a fused QKV
    q = qkv[:, 0]
    out_buffer = torch.full((2, 2, 8, 64), float("nan"))
    out = out_buffer[:, 1]
    args = (batch.k_cache, batch.v_cache, batch.block_tables, batch.seq_lens, 0.125)
    paged_decode_triton(q, *args, out=out, target_items=8, **SMALL)
    expected = paged_decode_ref(q, *args)
    assert relative_error_per_row(out, expected).max() <= 1e-4
    assert out_buffer[:, 0].isnan().all()  # nothing written outside `out`


# ---------------------------------------------------------------- on the GPU (bf16)

gpu = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


@pytest.mark.gpu
@gpu
@pytest.mark.parametrize("group", [1, 4, 8])
@pytest.mark.parametrize("block_size", [8, 16, 32])
def test_gpu_decode_bf16(group, block_size):
    lens = [1, 17, 100, 513, 4097, 8190, 33, 2048]
    for target_items in (None, 1, 200):
        check_decode(lens, group, num_kv_heads=8, head_dim=128, block_size=block_size,
                     dtype=torch.bfloat16, device="cuda", target_items=target_items, seed=group)


@pytest.mark.gpu
@gpu
def test_gpu_decode_mixed_batches_of_every_seq_block_variant():
    rng = random.Random(3)
    for num_seqs in (3, 100, 1100):  # the three SEQ_BLOCK variants, the last one looping
        lens = mixed_lengths(rng, num_seqs, 20000)
        check_decode(lens, 4, num_kv_heads=8, head_dim=128, dtype=torch.bfloat16, device="cuda",
                     seed=num_seqs)


@pytest.mark.gpu
@gpu
def test_gpu_decode_replays_in_a_cuda_graph_on_any_mix_of_lengths():
    """Captured once, replayed on new lengths: the grid and the plan never depend on host data."""
    batch = random_paged_batch([3000, 3000, 3000, 3000], 8, 128, 16, torch.bfloat16, "cuda")
    q = torch.randn(4, 32, 128, dtype=torch.bfloat16, device="cuda")
    seq_lens = batch.seq_lens.clone()
    out = torch.empty_like(q)
    args = (batch.k_cache, batch.v_cache, batch.block_tables)
    paged_decode_triton(q, *args, seq_lens, 0.088, out=out)  # compile
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        paged_decode_triton(q, *args, seq_lens, 0.088, out=out)
    for lens in ([3000, 1, 17, 2500], [5, 2999, 1000, 64], [1, 1, 1, 3000], [0, 40, 3000, 3000]):
        seq_lens.copy_(torch.tensor(lens, dtype=torch.int32))
        out.fill_(float("nan"))
        graph.replay()
        check_against_reference(
            out, lambda cd: paged_decode_ref(q, *args, seq_lens, 0.088, compute_dtype=cd),
            torch.bfloat16,
        )
