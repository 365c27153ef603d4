"""The batches the attention-kernel benchmark (benchmarks/bench_kernels.py) measures: what each
case is, the seeded drawing of its mixed lengths, the bytes and FLOPs it must move or do, and the
tensors one case is checked and timed on.

Every batch is a random paged batch (raypaged.kernels.testing.random_paged_batch): K/V scattered
over a pool 4x larger than needed through randomly permuted block tables, with everything a kernel
must not read (the tail of each last block, unused blocks, the table entries past a request's
blocks) poisoned with NaN. Every implementation reads that same pool, or for torch SDPA
contiguous copies of the same K/V.
"""

from __future__ import annotations

import math
import random
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from benchmarks.lib.common import L2_BYTES
from raypaged.kernels.reference import paged_decode_ref, paged_prefill_ref
from raypaged.kernels.testing import new_token_kv, query_start_loc, random_paged_batch

TABLE_ENTRY_BYTES = 4  # int32 block ids and sequence lengths


@dataclass(frozen=True, kw_only=True)
class Heads:
    """A case's attention geometry, Llama-3-8B's unless given: query and KV heads, head dim,
    block (page) size."""

    num_q_heads: int = 32
    num_kv_heads: int = 8
    head_dim: int = 128
    block_size: int = 16


@dataclass(frozen=True)
class DecodeCase(Heads):
    """One decode step: one query token per request, each over its seq_lens context."""

    label: str
    seq_lens: tuple[int, ...]

    @property
    def name(self) -> str:
        return f"{self.label}_q{self.num_q_heads}kv{self.num_kv_heads}_d{self.head_dim}_b{self.block_size}"

    @property
    def uniform(self) -> bool:
        """Every request of one length: the batch torch SDPA can take as one dense tensor."""
        return len(set(self.seq_lens)) == 1

    def kv_bytes(self, itemsize: int) -> int:
        """K and V of every context token, each read once."""
        return 2 * sum(self.seq_lens) * self.num_kv_heads * self.head_dim * itemsize

    def bytes(self, itemsize: int) -> int:
        """All a step must move: K/V once, q read and out written once, each request's block-table
        entries and length."""
        pages = sum(-(-n // self.block_size) for n in self.seq_lens)
        q_and_out = 2 * len(self.seq_lens) * self.num_q_heads * self.head_dim * itemsize
        return self.kv_bytes(itemsize) + q_and_out + (pages + len(self.seq_lens)) * TABLE_ENTRY_BYTES

    def describe(self, itemsize: int) -> dict:
        lens = sorted(self.seq_lens)
        return {"name": self.name, "kind": "uniform" if self.uniform else "mixed", "batch": len(lens),
                "num_q_heads": self.num_q_heads, "num_kv_heads": self.num_kv_heads,
                "head_dim": self.head_dim, "block_size": self.block_size,
                "seq_lens": {"min": lens[0], "median": lens[len(lens) // 2], "max": lens[-1],
                             "total": sum(lens)},
                "seq_lens_in_order": list(self.seq_lens),
                "kv_bytes": self.kv_bytes(itemsize), "bytes": self.bytes(itemsize)}


@dataclass(frozen=True)
class PrefillCase(Heads):
    """One prefill/extend step: sequence s appends new[s] tokens to a cached prefix of cached[s]."""

    label: str
    cached: tuple[int, ...]
    new: tuple[int, ...]

    @property
    def name(self) -> str:
        return self.label

    @property
    def seq_lens(self) -> tuple[int, ...]:
        return tuple(c + n for c, n in zip(self.cached, self.new, strict=True))

    @property
    def fresh_uniform(self) -> bool:
        """No cached prefix and one length: the batch torch SDPA can take as one dense tensor."""
        return not any(self.cached) and len(set(self.new)) == 1

    def flops(self) -> float:
        """Two matmuls over the pairs causal attention keeps: new token i of a sequence attends
        its cached prefix and new tokens 0..i."""
        pairs = sum(n * c + n * (n + 1) / 2 for c, n in zip(self.cached, self.new, strict=True))
        return 4 * self.num_q_heads * self.head_dim * pairs

    def describe(self) -> dict:
        return {"name": self.name, "batch": len(self.new), "cached": list(self.cached), "new": list(self.new),
                "num_q_heads": self.num_q_heads, "num_kv_heads": self.num_kv_heads,
                "head_dim": self.head_dim, "block_size": self.block_size, "flops": self.flops()}


def lognormal_lengths(count: int, median: float, sigma: float, longest: int, seed: int,
                      shortest: int = 16) -> tuple[int, ...]:
    """`count` context lengths: count - 1 drawn lognormal around `median` (a long upper tail),
    clipped to [shortest, longest], and one of exactly `longest` at a random place."""
    rng = random.Random(seed)
    lens = [min(longest, max(shortest, round(rng.lognormvariate(math.log(median), sigma))))
            for _ in range(count - 1)]
    lens.insert(rng.randrange(count), longest)
    return tuple(lens)


def long_among_short(short_count: int, short_range: tuple[int, int], longest: int,
                     seed: int) -> tuple[int, ...]:
    """short_count lengths uniform in short_range (inclusive) and one of `longest` at a random
    place."""
    rng = random.Random(seed)
    lens = [rng.randint(*short_range) for _ in range(short_count)]
    lens.insert(rng.randrange(short_count + 1), longest)
    return tuple(lens)


# The headline batch: 64 requests, long-tailed, one of 32k (~0.7 GB of K/V at 8 KV heads).
LOGNORMAL_64 = lognormal_lengths(64, median=1400, sigma=1.2, longest=32768, seed=19)

# Each axis the kernels depend on, moved one at a time from Llama-3-8B's 32 q / 8 kv heads, d 128,
# block 16: GQA group 8 and 1, head dim 64 (Llama-3.2-1B's heads), a 0.5B-class model's 14 q /
# 2 kv heads at d 64 (group 7), block 32; and two more mixes beside the lognormal one.
DECODE_CASES = [
    DecodeCase("uniform1x32768", (32768,)),
    DecodeCase("uniform8x8192", (8192,) * 8),
    DecodeCase("uniform64x4096", (4096,) * 64),
    DecodeCase("uniform256x1024", (1024,) * 256),
    DecodeCase("uniform64x4096", (4096,) * 64, num_q_heads=14, num_kv_heads=2, head_dim=64),
    DecodeCase("lognormal64", LOGNORMAL_64),
    DecodeCase("lognormal64", LOGNORMAL_64, block_size=32),
    DecodeCase("lognormal64", LOGNORMAL_64, num_kv_heads=4),
    DecodeCase("lognormal64", LOGNORMAL_64, num_q_heads=8, num_kv_heads=8),
    DecodeCase("lognormal64", LOGNORMAL_64, head_dim=64),
    DecodeCase("lognormal64", LOGNORMAL_64, num_q_heads=14, num_kv_heads=2, head_dim=64),
    # One 32k conversation among 127 short ones (about a third of the bytes).
    DecodeCase("long_among_short128", long_among_short(127, (128, 1024), 32768, seed=20)),
    # What is left of a batch once most of it has finished: 15 short requests beside one 64k,
    # which holds ~95% of the bytes.
    DecodeCase("finished_beside_64k", long_among_short(15, (64, 1024), 65536, seed=21)),
]

PREFILL_CASES = [
    PrefillCase("fresh_1x4096", (0,), (4096,)),
    PrefillCase("fresh_1x8192", (0,), (8192,)),
    PrefillCase("fresh_8x1024", (0,) * 8, (1024,) * 8),
    PrefillCase("extend_8x1024+512", (1024,) * 8, (512,) * 8),
    PrefillCase("extend_1x4096+1024", (4096,), (1024,)),
]

# --smoke: the same code paths (uniform and mixed decode, fresh and extending prefill) at sizes
# the CPU interpreter runs in seconds.
SMOKE_DECODE_CASES = [
    DecodeCase("uniform2x40", (40, 40), num_q_heads=4, num_kv_heads=2, head_dim=32),
    DecodeCase("lognormal5", lognormal_lengths(5, median=24, sigma=1.0, longest=100, seed=1),
               num_q_heads=4, num_kv_heads=2, head_dim=32),
]
SMOKE_PREFILL_CASES = [
    PrefillCase("fresh_1x48", (0,), (48,), num_q_heads=4, num_kv_heads=2, head_dim=32),
    PrefillCase("extend_2x20+9", (20, 20), (9, 9), num_q_heads=4, num_kv_heads=2, head_dim=32),
]


@dataclass
class Kernel:
    """One implementation bound to one batch. run(i) computes rotation variant i (what is timed);
    to_tokens maps what run returned to the reference's [tokens, Hq, D] (only for the check)."""

    run: Callable[[int], torch.Tensor]
    to_tokens: Callable[[torch.Tensor], torch.Tensor] = field(default=lambda out: out)


class _References:
    """The torch reference of a batch at each matmul precision, computed once."""

    def __init__(self, compute: Callable[[torch.dtype], torch.Tensor]) -> None:
        self._compute = compute
        self._done: dict[torch.dtype, torch.Tensor] = {}

    def __call__(self, compute_dtype: torch.dtype) -> torch.Tensor:
        if compute_dtype not in self._done:
            self._done[compute_dtype] = self._compute(compute_dtype)
        return self._done[compute_dtype]


class DecodeBatch:
    """A decode case's tensors: `variants` distinct copies of the batch (own K/V, tables and
    queries, one pool) side by side as rows, so that timed calls can rotate over more bytes than
    L2 holds (rotate=False: one copy). out is shared by the implementations, which write rows(i)."""

    def __init__(self, case: DecodeCase, dtype: torch.dtype, device: torch.device, rotate: bool) -> None:
        self.case, self.dtype = case, dtype
        self.variants = max(1, math.ceil(4 * L2_BYTES / case.kv_bytes(dtype.itemsize))) if rotate else 1
        lens = list(case.seq_lens) * self.variants
        self.paged = random_paged_batch(lens, case.num_kv_heads, case.head_dim, case.block_size, dtype,
                                        device, pool_factor=4)
        self.q = torch.randn((len(lens), case.num_q_heads, case.head_dim), device=device).to(dtype)
        self.out = torch.empty_like(self.q)
        self.scale = case.head_dim**-0.5
        p = self.paged
        self.reference = _References(lambda cd: paged_decode_ref(
            self.q, p.k_cache, p.v_cache, p.block_tables, p.seq_lens, self.scale, compute_dtype=cd))
        self._dense: tuple[torch.Tensor, torch.Tensor] | None = None
        if not case.uniform:  # only SDPA wants the dense copies, and only of a uniform batch
            p.keys = p.values = []

    def rows(self, i: int) -> slice:
        batch = len(self.case.seq_lens)
        return slice(i * batch, (i + 1) * batch)

    def dense_kv(self) -> tuple[torch.Tensor, torch.Tensor]:
        """K and V as contiguous [requests, Hkv, seq_len, D] (uniform cases): the same values the
        pool holds, laid out as SDPA takes them."""
        if self._dense is None:
            if not self.case.uniform:
                raise ValueError(f"{self.case.name}: mixed lengths have no dense [B, H, L, D] form")
            p = self.paged
            self._dense = (torch.stack(p.keys).transpose(1, 2).contiguous(),
                           torch.stack(p.values).transpose(1, 2).contiguous())
            p.keys = p.values = []
        return self._dense


class PrefillBatch:
    """A prefill case's tensors: every sequence's prefix and new tokens in the pool, q of the new
    tokens, and this step's own k/v (k_new, v_new) as the attention layer passes them."""

    def __init__(self, case: PrefillCase, dtype: torch.dtype, device: torch.device) -> None:
        self.case, self.dtype, self.variants = case, dtype, 1
        self.paged = random_paged_batch(list(case.seq_lens), case.num_kv_heads, case.head_dim, case.block_size,
                                        dtype, device)
        tokens = sum(case.new)
        self.q = torch.randn((tokens, case.num_q_heads, case.head_dim), device=device).to(dtype)
        self.out = torch.empty_like(self.q)
        self.k_new, self.v_new = new_token_kv(self.paged, list(case.new))
        self.query_start_loc = query_start_loc(list(case.new), device)
        self.scale = case.head_dim**-0.5
        p = self.paged
        self.args = (p.k_cache, p.v_cache, p.block_tables, self.query_start_loc, p.seq_lens, self.scale)
        self.reference = _References(lambda cd: paged_prefill_ref(self.q, *self.args, compute_dtype=cd))

    def rows(self, i: int) -> slice:
        return slice(None)

    def dense_kv(self) -> tuple[torch.Tensor, torch.Tensor]:
        """K and V as contiguous [sequences, Hkv, new, D] (fresh uniform cases)."""
        if not self.case.fresh_uniform:
            raise ValueError(f"{self.case.name}: a cached prefix or mixed lengths have no dense form")
        batch, length = len(self.case.new), self.case.new[0]
        shape = (batch, length, self.case.num_kv_heads, self.case.head_dim)
        return (self.k_new.view(shape).transpose(1, 2).contiguous(),
                self.v_new.view(shape).transpose(1, 2).contiguous())
