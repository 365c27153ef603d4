"""The Triton paged decode kernel and its work plan (decode_work.py) against the torch reference.

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

from raypaged.kernels.decode_work import max_items, plan
from raypaged.kernels.paged_decode import MERGE_BLOCK, default_target_items, paged_decode_triton
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
    chunk = max(-(-sum(lens) // target), min_chunk)
    for seq, length in enumerate(lens):
        own = [i for i in items if i.seq == seq]
        assert own[0].start == 0 and own[-1].end == length  # in order, no gap, no overlap
        assert all(a.end == b.start for a, b in zip(own, own[1:]))
        if len(own) > 1:  # a split sequence's items are balanced: under 2 chunks (plus a tile)
            assert max(i.end - i.start for i in own) < 2 * chunk + tile
    assert [i.seq for i in items] == sorted(i.seq for i in items)


def test_plan_splits_a_lone_long_sequence_and_leaves_a_uniform_batch_whole():
    assert len(plan([32768], 66, 128, 64)) == 64  # batch 1 fills the card
    assert len(plan([4096] * 64, 66, 128, 64)) == 64  # 64 x 8 heads already do: one item each
    assert len(plan([200], 66, 128, 64)) == 1  # too short to be worth a split
    mixed = plan([500] * 63 + [32768], 66, 128, 64)
    assert sum(i.seq == 63 for i in mixed) >= 16  # the long one is shared out


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
    # 2,000 tokens into items of 32: 63 for one sequence, more than a merge block holds.
    lens, target = [5, 2000], 100
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


def test_decode_counters_are_left_at_zero_for_the_next_launch():
    # Two launches of a split batch in a row: a counter left behind would merge the second early.
    batch = random_paged_batch([300, 40], 2, 64, 16)
    args = (batch.k_cache, batch.v_cache, batch.block_tables, batch.seq_lens, 0.125)
    for seed in (1, 2):
        q = torch.randn(2, 4, 64, generator=torch.Generator().manual_seed(seed))
        out = paged_decode_triton(q, *args, target_items=8, **SMALL)
        assert relative_error_per_row(out, paged_decode_ref(q, *args)).max() <= 1e-4


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
