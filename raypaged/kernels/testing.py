"""Random paged KV batches for the kernel tests and benchmarks.

A batch scatters each request's K/V over physical blocks drawn at random from a pool several
times larger than needed, and poisons with NaN everything a kernel must not read: the unused
tail of each request's last block, the unused blocks, and the blocks that the unused entries of
each block-table row point at. A kernel that reads past a request's length, or follows a table
entry it should not, returns NaN and fails.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

# Above this many elements a pool is poisoned only where the block tables point (used blocks and
# decoys), so a multi-GiB pool allocated lazily by the OS stays mostly untouched.
FULL_POISON_LIMIT = 1 << 26


@dataclass
class PagedBatch:
    k_cache: torch.Tensor  # [num_blocks, block_size, Hkv, D] (a view: strides may be unusual)
    v_cache: torch.Tensor
    block_tables: torch.Tensor  # [S, max_blocks] int32
    seq_lens: torch.Tensor  # [S] int32
    keys: list[torch.Tensor]  # per request, [seq_len, Hkv, D], the dense truth
    values: list[torch.Tensor]

    @property
    def block_size(self) -> int:
        return self.k_cache.shape[1]


def _allocate_pools(
    num_blocks: int, block_size: int, num_kv_heads: int, head_dim: int, dtype, device, layout: str
) -> tuple[torch.Tensor, torch.Tensor]:
    """K and V pools as [num_blocks, block_size, Hkv, D] views of one of three storage layouts."""
    if layout == "separate":
        shape = (num_blocks, block_size, num_kv_heads, head_dim)
        return torch.empty(shape, dtype=dtype, device=device), torch.empty(shape, dtype=dtype, device=device)
    if layout == "interleaved":  # one buffer, K and V of a slot side by side
        buffer = torch.empty(
            (num_blocks, block_size, 2, num_kv_heads, head_dim), dtype=dtype, device=device
        )
        return buffer[:, :, 0], buffer[:, :, 1]
    if layout == "head_major":  # storage [num_blocks, Hkv, block_size, D]
        shape = (num_blocks, num_kv_heads, block_size, head_dim)
        k = torch.empty(shape, dtype=dtype, device=device).transpose(1, 2)
        v = torch.empty(shape, dtype=dtype, device=device).transpose(1, 2)
        return k, v
    raise ValueError(f"unknown layout {layout!r}")


def random_paged_batch(
    seq_lens: list[int],
    num_kv_heads: int,
    head_dim: int,
    block_size: int,
    dtype: torch.dtype = torch.float32,
    device: str | torch.device = "cpu",
    *,
    pool_factor: int = 4,
    num_blocks: int | None = None,
    high_block_ids: bool = False,
    extra_table_blocks: int = 2,
    layout: str = "separate",
    contiguous: bool = False,
    generator: torch.Generator | None = None,
) -> PagedBatch:
    """A batch of requests with the given lengths, K/V ~ N(0, 1).

    num_blocks: pool size (default pool_factor x the blocks needed). high_block_ids draws the
    physical ids from the top of the pool (where int32 offsets overflow on a big pool).
    contiguous: identity block tables (request s owns consecutive blocks), for measuring what
    paging costs; no decoys then.
    """
    blocks_per_seq = [-(-n // block_size) for n in seq_lens]
    needed = sum(blocks_per_seq)
    decoys = len(seq_lens) * extra_table_blocks
    if num_blocks is None:
        num_blocks = max(pool_factor * (needed + decoys), needed + decoys, 1)
    if needed + decoys > num_blocks:
        raise ValueError(f"pool of {num_blocks} blocks cannot hold {needed + decoys}")
    k_cache, v_cache = _allocate_pools(
        num_blocks, block_size, num_kv_heads, head_dim, dtype, device, layout
    )

    if contiguous:
        physical = torch.arange(needed + decoys)
    elif high_block_ids:
        span = min(num_blocks, 4 * (needed + decoys))
        physical = num_blocks - span + torch.randperm(span, generator=generator)[: needed + decoys]
    else:
        physical = torch.randperm(num_blocks, generator=generator)[: needed + decoys]
    max_blocks = max(blocks_per_seq, default=0) + extra_table_blocks
    tables = torch.empty((len(seq_lens), max(max_blocks, 1)), dtype=torch.int64)
    used, decoy_ids = physical[:needed].tolist(), physical[needed:].tolist()
    for s, count in enumerate(blocks_per_seq):
        row = used[:count] + decoy_ids[s * extra_table_blocks : (s + 1) * extra_table_blocks]
        used = used[count:]
        # Entries past the decoys repeat them: still poisoned, never a read past the pool.
        row += [row[-1] if row else decoy_ids[0]] * (tables.shape[1] - len(row))
        tables[s] = torch.tensor(row)

    if k_cache.numel() <= FULL_POISON_LIMIT:
        k_cache.fill_(float("nan"))
        v_cache.fill_(float("nan"))
    else:
        referenced = physical.to(device)
        k_cache[referenced] = float("nan")
        v_cache[referenced] = float("nan")

    # Draw on the generator's device (CPU in tests: reproducible), else straight on `device`.
    source = generator.device if generator is not None else device
    keys, values = [], []
    for s, length in enumerate(seq_lens):
        shape = (length, num_kv_heads, head_dim)
        k = torch.randn(shape, generator=generator, device=source).to(dtype)
        v = torch.randn(shape, generator=generator, device=source).to(dtype)
        positions = torch.arange(length)
        blocks = tables[s, positions // block_size].to(device)
        offsets = (positions % block_size).to(device)
        k_cache[blocks, offsets] = k.to(device)
        v_cache[blocks, offsets] = v.to(device)
        keys.append(k.to(device))
        values.append(v.to(device))
    return PagedBatch(
        k_cache=k_cache,
        v_cache=v_cache,
        block_tables=tables.to(torch.int32).to(device),
        seq_lens=torch.tensor(seq_lens, dtype=torch.int32, device=device),
        keys=keys,
        values=values,
    )


def query_start_loc(query_lens: list[int], device: str | torch.device = "cpu") -> torch.Tensor:
    """cu_seqlens [S+1] int32 of the new tokens."""
    starts = [0]
    for n in query_lens:
        starts.append(starts[-1] + n)
    return torch.tensor(starts, dtype=torch.int32, device=device)


def relative_error_per_row(out: torch.Tensor, ref: torch.Tensor) -> torch.Tensor:
    """‖out − ref‖ / ‖ref‖ for every (token, head) row, in float64. NaN stays NaN."""
    diff = (out.double() - ref.double()).flatten(0, -2).norm(dim=-1)
    return diff / ref.double().flatten(0, -2).norm(dim=-1).clamp_min(1e-30)


def check_against_reference(out: torch.Tensor, reference_fn, dtype: torch.dtype) -> float:
    """Raise AssertionError unless `out` matches the reference; return its worst row error.

    reference_fn(compute_dtype) gives the reference at that matmul precision. fp32: ≤ 1e-4
    relative per (token, head) row. fp16/bf16: within 2x (+1e-3) of the error the reference
    itself makes when computed in that dtype. NaN or inf never passes.
    """
    if not torch.isfinite(out).all():
        raise AssertionError("NaN/inf in the kernel output")
    exact = reference_fn(torch.float32)
    error = relative_error_per_row(out, exact).max().item()
    if dtype == torch.float32:
        limit = 1e-4
    else:
        baseline = relative_error_per_row(reference_fn(dtype), exact).max().item()
        limit = 2 * baseline + 1e-3
    if not error <= limit:
        raise AssertionError(f"relative error {error:.3g} > {limit:.3g} ({dtype})")
    return error


def new_token_kv(
    batch: PagedBatch, query_lens: list[int], *, poison_cache: bool = False
) -> tuple[torch.Tensor, torch.Tensor]:
    """This step's k/v [T, Hkv, D]: the last query_lens[s] positions of each request.

    poison_cache: also fill those positions' cache slots with NaN, so a kernel told to read the
    new tokens from k/v fails if it reads them through the block table instead.
    """
    keys, values = [], []
    for s, q_len in enumerate(query_lens):
        length = batch.keys[s].shape[0]
        keys.append(batch.keys[s][length - q_len :])
        values.append(batch.values[s][length - q_len :])
        if poison_cache and q_len:
            positions = torch.arange(length - q_len, length, device=batch.k_cache.device)
            blocks = batch.block_tables[s, positions // batch.block_size].long()
            offsets = positions % batch.block_size
            batch.k_cache[blocks, offsets] = float("nan")
            batch.v_cache[blocks, offsets] = float("nan")
    return torch.cat(keys), torch.cat(values)


def poison_before_window(batch: PagedBatch, query_lens: list[int], window: int,
                         free_blocks: bool = True) -> None:
    """NaN into every slot no query of request s may read under a sliding window: the positions
    before its earliest new query's window (p - window, p], so a kernel that reads them fails.
    free_blocks: then the table entries wholly before the window become -1, as a sliding
    KV-cache group's table holds the blocks it gave back: a kernel must not load through them."""
    for s, q_len in enumerate(query_lens):
        length = batch.keys[s].shape[0]
        floor = max(0, length - q_len - window + 1)
        if floor:
            positions = torch.arange(floor, device=batch.k_cache.device)
            blocks = batch.block_tables[s, positions // batch.block_size].long()
            offsets = positions % batch.block_size
            batch.k_cache[blocks, offsets] = float("nan")
            batch.v_cache[blocks, offsets] = float("nan")
            if free_blocks:
                batch.block_tables[s, :floor // batch.block_size] = -1
