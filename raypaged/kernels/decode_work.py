"""The work list of paged decode: the batch's KV cut into items of about equal size.

A serving batch is never uniform: one long conversation decodes beside many short ones. Cutting
every sequence into the same number of splits either leaves the long one's KV to a handful of
programs while the rest of the card idles, or cuts short ones into pieces too small to pay for
their merge. Instead the whole batch's KV is cut into items of about `chunk` tokens, sized for
the batch's total (FlashInfer's load-balanced decode schedule does the same):

  chunk    = max(ceil(total_tokens / target_items), min_chunk)
  items_s  = max(len_s // chunk, 1), then each of those is an `align`-rounded ceil(len_s / items_s)
             tokens long (the last one shorter), and items_s drops to the number that covers len_s

so every item of a split sequence is under 2 x chunk (+ align) tokens, and the batch has at most
num_seqs + target_items items (len // chunk summed over the batch is at most total / chunk <=
target_items, plus at most one per sequence) and at most target_items // 2 split sequences (each
holds >= 2 chunks). Those bounds size the decode and merge grids: shapes only, so a CUDA graph
captured once serves any mix of lengths, and entries past the batch's count are -1.

Items run largest first, as a list scheduler wants (the GPU starts programs roughly in grid
order, so what runs last should be small): the sequences of >= chunk tokens (the split ones among
them), then those of >= chunk / 4, then the rest; a sequence's items stay together, in order.

One program computes the list on the device from seq_lens (`plan_decode_work`), once per step:
every layer's decode reads the same list. Layout, int32 [WORK_FIELDS, max_items]: rows ITEM_* per
work item, SEQ_* per sequence, MERGES the split sequences. `plan` is the same arithmetic on the
host, for tests and benchmarks.

A sliding-window layer (window W) gets its own list: each sequence is planned as its last
min(len, W) keys, its items offset to start at len - min(len, W), so nothing before the window
is read and a 32k sequence under a 4k window costs 4k of bytes.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from .pdl import pdl_launch, wait_for_inputs

# The list's rows (the kernels take each row as its own pointer). ITEM_COUNT: the item's
# sequence's item count; SEQ_ORDER: the sequences in the list's order.
(ITEM_SEQ, ITEM_START, ITEM_END, ITEM_COUNT, SEQ_FIRST, SEQ_COUNT, SEQ_ITEM_LEN, MERGES,
 SEQ_ORDER) = range(9)
WORK_FIELDS = 9
# Lanes the plan's one program works in: a small batch's list fits the small block (its passes
# are latency on every step's critical path), a larger one takes the large block (and loops past it).
PLAN_BLOCKS = (128, 1024)
# Size classes the items run in, largest first (see _size_class).
NUM_SIZE_CLASSES = 3
# The width is a multiple of this, so every row starts 16-byte aligned: Triton specialises
# pointers on alignment, and a row that were not would compile another variant mid-serving.
_WIDTH_MULTIPLE = 4


@triton.jit
def _items_of(lens, chunk, ALIGN: tl.constexpr):
    """Per sequence of `lens`: (number of items, tokens per item)."""
    wanted = tl.maximum(lens // chunk, 1)
    item_len = tl.cdiv(tl.cdiv(lens, wanted), ALIGN) * ALIGN
    # An empty sequence is one empty item (its output: zeros).
    items = tl.where(item_len > 0, tl.cdiv(lens, tl.maximum(item_len, 1)), 1)
    return items, item_len


@triton.jit
def _in_window(lens, window):
    """The keys a sequence's last query reads: all of them, or the last `window` (window > 0)."""
    return tl.where(window > 0, tl.minimum(lens, window), lens)


@triton.jit
def _maximum(a, b):
    return tl.maximum(a, b)


@triton.jit
def _size_class(lens, chunk, NUM_CLASSES: tl.constexpr):
    """0 for a sequence of >= chunk tokens (split ones among them), then one class per quarter
    below, the last one taking the rest: the list runs its items by class, largest first."""
    size_class = tl.zeros_like(lens)
    threshold = chunk
    for _ in tl.static_range(NUM_CLASSES - 1):
        size_class += (lens < threshold).to(lens.dtype)
        threshold = threshold // 4
    return size_class


# Ints that vary from step to step are left unspecialised: no variant compiles mid-serving.
@triton.jit(do_not_specialize=["num_seqs", "width", "target_items", "min_chunk", "window"])
def _plan_kernel(seq_lens_ptr, item_seq_ptr, item_start_ptr, item_end_ptr, item_count_ptr,
                 seq_first_ptr, seq_count_ptr, seq_item_len_ptr, merges_ptr, seq_order_ptr,
                 num_seqs, width, target_items, min_chunk, window, ALIGN: tl.constexpr,
                 NUM_CLASSES: tl.constexpr, BLOCK: tl.constexpr, USE_PDL: tl.constexpr):
    wait_for_inputs(USE_PDL)
    total = 0
    for start in range(0, num_seqs, BLOCK):
        index = start + tl.arange(0, BLOCK)
        total += tl.sum(_in_window(tl.load(seq_lens_ptr + index, mask=index < num_seqs, other=0),
                                   window))
    chunk = tl.maximum(tl.cdiv(total, target_items), min_chunk)

    # Sequences are ranked class by class (in index order within one); each marks its first item
    # with its rank, a running max over the items then names every item's rank, and the order
    # row its sequence.
    for start in range(0, width, BLOCK):
        index = start + tl.arange(0, BLOCK)
        tl.store(item_seq_ptr + index, -1, mask=index < width)
        tl.store(merges_ptr + index, -1, mask=index < width)
    tl.debug_barrier()
    num_items = 0
    num_ranked = 0
    num_merges = 0
    for size_class in tl.static_range(NUM_CLASSES):
        for start in range(0, num_seqs, BLOCK):
            index = start + tl.arange(0, BLOCK)
            valid = index < num_seqs
            lens = _in_window(tl.load(seq_lens_ptr + index, mask=valid, other=0), window)
            items, item_len = _items_of(lens, chunk, ALIGN)
            mine = valid & (_size_class(lens, chunk, NUM_CLASSES) == size_class)
            counted = tl.where(mine, items, 0)
            firsts = tl.cumsum(counted, 0) - counted + num_items
            ranks = tl.cumsum(mine.to(tl.int32), 0) - 1 + num_ranked
            tl.store(seq_first_ptr + index, firsts, mask=mine)
            tl.store(seq_count_ptr + index, items, mask=mine)
            tl.store(seq_item_len_ptr + index, item_len, mask=mine)
            tl.store(seq_order_ptr + ranks, index, mask=mine)
            tl.store(item_seq_ptr + firsts, ranks, mask=mine)
            num_items += tl.sum(counted)
            num_ranked += tl.sum(mine.to(tl.int32))
            if size_class == 0:  # split sequences are all in the first class
                split = valid & (items > 1)
                slots = tl.cumsum(split.to(tl.int32), 0) - 1 + num_merges
                tl.store(merges_ptr + slots, index, mask=split)
                num_merges += tl.sum(split.to(tl.int32))
    tl.debug_barrier()
    so_far = -1
    for start in range(0, width, BLOCK):
        index = start + tl.arange(0, BLOCK)
        marks = tl.load(item_seq_ptr + index, mask=index < width, other=-1)
        rank = tl.maximum(tl.associative_scan(marks, 0, _maximum), so_far)
        so_far = tl.max(rank, 0)
        in_plan = index < num_items
        seq = tl.load(seq_order_ptr + tl.maximum(rank, 0), mask=in_plan, other=0)
        first = tl.load(seq_first_ptr + seq, mask=in_plan, other=0)
        count = tl.load(seq_count_ptr + seq, mask=in_plan, other=0)
        item_len = tl.load(seq_item_len_ptr + seq, mask=in_plan, other=0)
        length = tl.load(seq_lens_ptr + seq, mask=in_plan, other=0)
        begin = (index - first) * item_len + length - _in_window(length, window)
        tl.debug_barrier()  # every lane has read its marks before any is overwritten
        stored = index < width
        tl.store(item_seq_ptr + index, tl.where(in_plan, seq, -1), mask=stored)
        tl.store(item_start_ptr + index, begin, mask=stored)
        tl.store(item_end_ptr + index, tl.minimum(begin + item_len, length), mask=stored)
        tl.store(item_count_ptr + index, count, mask=stored)


def plan_decode_work(seq_lens: torch.Tensor, target_items: int, min_chunk_tokens: int, align: int,
                     out: torch.Tensor | None = None, *,
                     sliding_window: int | None = None) -> torch.Tensor:
    """The work list of a decode batch with these seq_lens [S] int32 (module docstring), into
    `out` (int32 [WORK_FIELDS, max_items(S, target_items)], e.g. a CUDA graph's static buffer) if given.
    With a sliding window, only each sequence's last `sliding_window` keys. One small launch, no
    host synchronisation."""
    if target_items < 1 or min_chunk_tokens < 1 or align < 1:
        raise ValueError(f"target_items ({target_items}), min_chunk_tokens ({min_chunk_tokens}) "
                         f"and align ({align}) must be >= 1")
    if sliding_window is not None and sliding_window < 1:
        raise ValueError(f"sliding_window must be >= 1, got {sliding_window}")
    width = max_items(seq_lens.shape[0], target_items)
    if out is None:
        out = torch.empty((WORK_FIELDS, width), dtype=torch.int32, device=seq_lens.device)
    elif out.shape != (WORK_FIELDS, width) or out.dtype != torch.int32 or not out.is_contiguous():
        raise ValueError(f"work list buffer must be contiguous int32 {(WORK_FIELDS, width)}, got "
                         f"{out.dtype} {tuple(out.shape)}")
    _plan_kernel[(1,)](seq_lens, *out, seq_lens.shape[0], width, target_items, min_chunk_tokens,
                       sliding_window or 0, ALIGN=align, NUM_CLASSES=NUM_SIZE_CLASSES,
                       BLOCK=PLAN_BLOCKS[0] if width <= PLAN_BLOCKS[0] else PLAN_BLOCKS[1], num_warps=4,
                       **pdl_launch(seq_lens))
    return out


def max_items(num_seqs: int, target_items: int) -> int:
    """The bound on any batch's item count, rounded up to a multiple of 4: the decode grid and
    the work list's width."""
    return -(-(num_seqs + target_items) // _WIDTH_MULTIPLE) * _WIDTH_MULTIPLE


def max_merges(num_seqs: int, target_items: int) -> int:
    """The bound on any batch's split sequences: the merge grid."""
    return max(min(num_seqs, target_items // 2), 1)


@dataclass(frozen=True)
class WorkItem:
    seq: int
    start: int  # first token
    end: int  # one past the last


def plan(seq_lens: list[int], target_items: int, min_chunk: int, align: int,
         sliding_window: int | None = None) -> list[WorkItem]:
    """The work list's items for `seq_lens`, in its order (host ints; tests, benchmarks)."""
    full_lens = seq_lens
    if sliding_window is not None:
        seq_lens = [min(n, sliding_window) for n in seq_lens]
    chunk = max(_cdiv(sum(seq_lens), target_items), min_chunk)
    thresholds = [chunk // 4**k for k in range(NUM_SIZE_CLASSES - 1)]
    items: list[WorkItem] = []
    for seq in sorted(range(len(seq_lens)), key=lambda s: sum(seq_lens[s] < t for t in thresholds)):
        length = seq_lens[seq]
        wanted = max(length // chunk, 1)
        item_len = _cdiv(_cdiv(length, wanted), align) * align
        count = _cdiv(length, item_len) if item_len else 1
        skipped = full_lens[seq] - length  # keys before the window
        items += [WorkItem(seq, skipped + i * item_len, skipped + min((i + 1) * item_len, length))
                  for i in range(count)]
    return items


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)
