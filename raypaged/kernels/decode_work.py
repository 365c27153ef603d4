"""How paged decode divides a batch's KV into work items of about equal size.

A serving batch is never uniform: one long conversation decodes beside many short ones. Cutting
every sequence into the same number of splits either leaves the long one's KV to a handful of
programs while the rest of the card idles, or cuts short ones into pieces too small to pay for
their merge. Instead the whole batch's KV is cut into items of about `chunk` tokens, sized for
the batch's total (FlashInfer's load-balanced decode schedule does the same):

  chunk    = max(ceil(total_tokens / target_items), min_chunk)
  items_s  = max(len_s // chunk, 1), then each of those is a tile-aligned ceil(len_s / items_s)
             tokens long (the last one shorter), and items_s drops to the number that covers len_s

so every item is between chunk and 2 x chunk tokens (or the whole of a shorter sequence), and the
batch has at most num_seqs + target_items of them (len // chunk summed over the batch is at most
total / chunk <= target_items, plus at most one per sequence). That bound is the kernel's grid:
it depends on shapes only, so a CUDA graph captured once serves any mix of lengths, and items past
the batch's count exit at once. Items are numbered sequence by sequence; each program finds its
own from seq_lens on the device (a prefix sum over the batch), so there is no host-side list to
build or copy. `plan` below is the same arithmetic on the host, for tests and benchmarks.
"""

from __future__ import annotations

from dataclasses import dataclass

import triton
import triton.language as tl


@triton.jit
def _items_of(lens, chunk, TILE_N: tl.constexpr):
    """Per sequence of `lens`: (number of items, tokens per item)."""
    wanted = tl.maximum(lens // chunk, 1)
    item_len = tl.cdiv(tl.cdiv(lens, wanted), TILE_N) * TILE_N
    # An empty sequence is one empty item (its output: zeros).
    items = tl.where(item_len > 0, tl.cdiv(lens, tl.maximum(item_len, 1)), 1)
    return items, item_len


@triton.jit
def chunk_tokens(seq_lens_ptr, num_seqs, target_items, min_chunk, SEQ_BLOCK: tl.constexpr):
    """The batch's item size in tokens (see the module docstring)."""
    total = 0
    for start in range(0, num_seqs, SEQ_BLOCK):
        index = start + tl.arange(0, SEQ_BLOCK)
        total += tl.sum(tl.load(seq_lens_ptr + index, mask=index < num_seqs, other=0))
    return tl.maximum(tl.cdiv(total, target_items), min_chunk)


@triton.jit
def find_item(seq_lens_ptr, num_seqs, item, chunk, TILE_N: tl.constexpr, SEQ_BLOCK: tl.constexpr):
    """Where work item `item` lies: (seq, its first item, its item count, tokens per item, its
    length). seq == num_seqs when `item` is past the batch's last."""
    seq = num_seqs
    first = 0
    count = 1
    item_len = 0
    seq_len = 0
    before = 0  # items of the sequences ahead of this block
    for start in range(0, num_seqs, SEQ_BLOCK):
        index = start + tl.arange(0, SEQ_BLOCK)
        valid = index < num_seqs
        lens = tl.load(seq_lens_ptr + index, mask=valid, other=0)
        items, lengths = _items_of(lens, chunk, TILE_N)
        items = tl.where(valid, items, 0)
        ends = tl.cumsum(items, 0) + before
        starts = ends - items
        hit = valid & (starts <= item) & (item < ends)  # at most one lane, in one block
        found = tl.sum(hit.to(tl.int32)) > 0
        seq = tl.where(found, tl.sum(tl.where(hit, index, 0)), seq)
        first = tl.where(found, tl.sum(tl.where(hit, starts, 0)), first)
        count = tl.where(found, tl.sum(tl.where(hit, items, 0)), count)
        item_len = tl.where(found, tl.sum(tl.where(hit, lengths, 0)), item_len)
        seq_len = tl.where(found, tl.sum(tl.where(hit, lens, 0)), seq_len)
        before += tl.sum(items)
    return seq, first, count, item_len, seq_len


@dataclass(frozen=True)
class WorkItem:
    seq: int
    start: int  # first token
    end: int  # one past the last


def plan(seq_lens: list[int], target_items: int, min_chunk: int, tile_n: int) -> list[WorkItem]:
    """The kernel's items for `seq_lens`, in the kernel's order (host ints; tests, benchmarks)."""
    chunk = max(_cdiv(sum(seq_lens), target_items), min_chunk)
    items: list[WorkItem] = []
    for seq, length in enumerate(seq_lens):
        wanted = max(length // chunk, 1)
        item_len = _cdiv(_cdiv(length, wanted), tile_n) * tile_n
        count = _cdiv(length, item_len) if item_len else 1
        items += [WorkItem(seq, i * item_len, min((i + 1) * item_len, length)) for i in range(count)]
    return items


def max_items(num_seqs: int, target_items: int) -> int:
    """The grid's bound on any batch's item count (module docstring)."""
    return num_seqs + target_items


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)
