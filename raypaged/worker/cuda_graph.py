"""CUDA graphs of the decode forward: one per batch size, a step pads up to the next size.

An eager decode step of an 8B model launches a few hundred kernels and is bound by the CPU
launching them (~21 ms on the H200 against a 3.8 ms weight-read floor); replaying a captured
graph launches them all at once. Graphs need fixed addresses and fixed host-side values, so the
step's inputs are copied into static buffers; the decode kernel's grid depends on the batch size
only (paged_decode.py: its work items are found on the device), so any mix of lengths replays.
With KV-cache groups every group's block tables and slot mapping are static inputs too (one
buffer of [groups, …]); which group a layer reads is fixed at capture, never decided by data.
"""

from __future__ import annotations

import bisect
import functools
import logging
from collections.abc import Callable
from typing import TYPE_CHECKING, TypeVar

import torch

from raypaged.model.attention import AttentionMetadata

if TYPE_CHECKING:
    # What graph.pool() returns (torch imports it only for typing too: an import cycle).
    from torch.cuda import _POOL_HANDLE

logger = logging.getLogger(__name__)

T = TypeVar("T")


def capture_graph(fn: Callable[[], T], pool: _POOL_HANDLE | None = None,
                  warmup_stream: torch.cuda.Stream | None = None) -> tuple[torch.cuda.CUDAGraph, T]:
    """Warm `fn` up twice on a side stream (Triton compiles and autotunes outside the capture),
    then capture it into a graph drawing on memory pool `pool` (None: a new one, then
    `graph.pool()`). Returns the graph and what `fn` returned during the capture."""
    stream = warmup_stream or torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for _ in range(2):
            fn()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, pool=pool):
        output = fn()
    return graph, output


def capture_sizes(max_num_seqs: int) -> list[int]:
    sizes = [s for s in (1, 2, 4, 8) if s < max_num_seqs] + list(range(16, max_num_seqs, 16))
    return sorted(set(sizes + [max_num_seqs]))


class DecodeGraphs:
    def __init__(self, model: torch.nn.Module, kv_caches: list[tuple[torch.Tensor, torch.Tensor]],
                 max_num_seqs: int, max_blocks_per_req: int, device: torch.device,
                 layer_groups: tuple[int, ...] = ()) -> None:
        self.model = model
        self.layer_groups = layer_groups
        self.kv_caches = kv_caches
        self.sizes = capture_sizes(max_num_seqs)
        largest = self.sizes[-1]
        self.input_ids = torch.zeros(largest, dtype=torch.int64, device=device)
        self.positions = torch.zeros(largest, dtype=torch.int64, device=device)
        num_groups = max(layer_groups, default=0) + 1
        self.group_slot_mappings = torch.full((num_groups, largest), -1, dtype=torch.int64, device=device)
        self.group_block_tables = torch.zeros(num_groups, largest, max_blocks_per_req,
                                              dtype=torch.int32, device=device)
        self.slot_mapping = self.group_slot_mappings[0]
        self.block_tables = self.group_block_tables[0]
        self.seq_lens = torch.ones(largest, dtype=torch.int32, device=device)
        self.query_start_loc = torch.arange(largest + 1, dtype=torch.int32, device=device)
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.work: dict[int, torch.Tensor] = {}  # per size: the decode work list's buffer
        self.outputs: dict[int, torch.Tensor] = {}

    def _metadata(self, size: int) -> AttentionMetadata:
        return AttentionMetadata(
            slot_mapping=self.slot_mapping[:size], block_tables=self.block_tables[:size],
            seq_lens=self.seq_lens[:size], query_start_loc=self.query_start_loc[: size + 1],
            num_decodes=size, num_decode_tokens=size, max_query_len=1,
            group_block_tables=self.group_block_tables[:, :size] if self.layer_groups else None,
            group_slot_mappings=self.group_slot_mappings[:, :size] if self.layer_groups else None,
            layer_groups=self.layer_groups)

    @torch.inference_mode()
    def capture(self, pool: _POOL_HANDLE | None = None) -> _POOL_HANDLE | None:
        """Capture one graph per batch size into memory pool `pool` (None: a new one); returns
        the pool for other graphs to share."""
        stream = torch.cuda.Stream()
        # Largest first, so the smaller graphs fit in the memory pool the largest reserved.
        for size in reversed(self.sizes):
            graph, self.outputs[size] = capture_graph(functools.partial(self._forward, size), pool,
                                                      stream)
            pool = graph.pool()
            self.graphs[size] = graph
        torch.cuda.synchronize()
        logger.info("captured decode CUDA graphs for batch sizes %s", self.sizes)
        return pool

    def _forward(self, size: int) -> torch.Tensor:
        """What a graph holds: the step's decode work list (planned on the device from the
        static seq_lens, so a replay re-plans for the lengths copied in), then the model."""
        metadata = self._metadata(size)
        metadata.plan_decode(self.kv_caches[0][0].shape[2], out=self.work.get(size))
        if metadata.decode_work is not None:
            self.work[size] = metadata.decode_work
        return self.model(self.input_ids[:size], self.positions[:size], self.kv_caches, metadata)

    def can_run(self, metadata: AttentionMetadata) -> bool:
        return metadata.num_decodes == metadata.num_seqs and metadata.num_seqs <= self.sizes[-1]

    def run(self, input_ids: torch.Tensor, positions: torch.Tensor,
            metadata: AttentionMetadata) -> torch.Tensor:
        n = input_ids.shape[0]
        size = self.sizes[bisect.bisect_left(self.sizes, n)]
        self.input_ids[:n].copy_(input_ids)
        self.positions[:n].copy_(positions)
        self.seq_lens[:n].copy_(metadata.seq_lens)
        width = metadata.block_tables.shape[1]
        if metadata.group_block_tables is not None and metadata.group_slot_mappings is not None:
            self.group_slot_mappings[:, :n].copy_(metadata.group_slot_mappings)
            self.group_block_tables[:, :n, :width].copy_(metadata.group_block_tables)
        else:
            self.slot_mapping[:n].copy_(metadata.slot_mapping)
            self.block_tables[:n, :width].copy_(metadata.block_tables)
        if size > n:
            # Padding rows write nothing and read one token of whatever block their stale
            # table row names: valid memory, or a freed entry (-1) the kernel does not load;
            # results discarded.
            self.group_slot_mappings[:, n:size].fill_(-1)
            self.seq_lens[n:size].fill_(1)
        self.graphs[size].replay()
        return self.outputs[size][:n]
