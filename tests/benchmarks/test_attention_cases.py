"""The attention benchmark's batches (benchmarks/lib/attention_cases.py): the mixed lengths are
drawn reproducibly and have the shape they claim, the bytes and FLOPs are what the kernels must
move and do, and the case list covers every axis issue 19 names."""

from __future__ import annotations

import torch

from benchmarks.lib.attention_cases import (
    DECODE_CASES,
    LOGNORMAL_64,
    PREFILL_CASES,
    DecodeCase,
    PrefillCase,
    lognormal_lengths,
    long_among_short,
)


def test_lognormal_lengths_are_reproducible_long_tailed_and_hold_one_longest():
    lens = lognormal_lengths(64, median=1400, sigma=1.2, longest=32768, seed=19)
    assert lens == lognormal_lengths(64, median=1400, sigma=1.2, longest=32768, seed=19)
    assert lens != lognormal_lengths(64, median=1400, sigma=1.2, longest=32768, seed=20)
    assert len(lens) == 64 and lens.count(32768) == 1 and min(lens) >= 16
    rest = sorted(lens)[:-1]
    assert rest[len(rest) // 2] < 2 * 1400 < rest[-1] < 32768  # a tail well above the median
    assert LOGNORMAL_64 == lens


def test_one_long_request_among_short_ones():
    lens = long_among_short(15, (64, 1024), 65536, seed=21)
    assert len(lens) == 16 and lens.count(65536) == 1
    assert all(64 <= n <= 1024 for n in lens if n != 65536)


def test_decode_bytes_count_kv_once_plus_q_out_and_tables():
    case = DecodeCase("t", (17, 32), num_q_heads=4, num_kv_heads=2, head_dim=8, block_size=16)
    kv = 2 * (17 + 32) * 2 * 8 * 2  # K and V, tokens x heads x dim x bf16
    q_out = 2 * 2 * 4 * 8 * 2
    tables = (2 + 2) * 4 + 2 * 4  # 2 + 2 blocks, 2 lengths, int32
    assert case.kv_bytes(2) == kv and case.bytes(2) == kv + q_out + tables
    assert not case.uniform and DecodeCase("u", (5, 5)).uniform


def test_prefill_flops_count_the_causal_pairs():
    case = PrefillCase("t", cached=(3, 0), new=(2, 4), num_q_heads=2, head_dim=4)
    mask = [(c + i) + 1 for c, n in [(3, 2), (0, 4)] for i in range(n)]  # keys each new token sees
    assert case.flops() == 4 * 2 * 4 * sum(mask)
    assert case.seq_lens == (5, 4) and not case.fresh_uniform
    assert PrefillCase("f", (0, 0), (8, 8)).fresh_uniform


def test_the_cases_cover_every_axis_of_the_issue():
    names = [c.name for c in DECODE_CASES + PREFILL_CASES]
    assert len(names) == len(set(names))
    uniform = {(len(c.seq_lens), c.seq_lens[0]) for c in DECODE_CASES if c.uniform}
    assert {(1, 32768), (8, 8192), (64, 4096), (256, 1024)} <= uniform
    mixed = [c for c in DECODE_CASES if not c.uniform]
    assert {c.num_q_heads // c.num_kv_heads for c in mixed} >= {1, 4, 7, 8}
    assert {c.head_dim for c in mixed} == {64, 128} and {c.block_size for c in mixed} == {16, 32}
    assert any(max(c.seq_lens) == 65536 for c in mixed)
    assert any((c.num_q_heads, c.num_kv_heads, c.head_dim) == (14, 2, 64) for c in DECODE_CASES if c.uniform)
    headline = next(c for c in mixed if c.seq_lens == LOGNORMAL_64 and c.num_kv_heads == 8 and c.head_dim == 128
                    and c.block_size == 16 and c.num_q_heads == 32)
    assert 0.5e9 < headline.bytes(torch.bfloat16.itemsize) < 1e9  # ~0.7 GB: a ~170 µs byte floor
    extend = {(len(c.new), c.cached[0], c.new[0]) for c in PREFILL_CASES if any(c.cached)}
    assert (8, 1024, 512) in extend and any(b == 1 for b, _, _ in extend)
    fresh = {(len(c.new), c.new[0]) for c in PREFILL_CASES if c.fresh_uniform}
    assert {(1, 4096), (1, 8192)} <= fresh
