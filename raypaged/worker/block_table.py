"""The persistent block table: one row per request the worker holds, updated by diffs; one
table per KV-cache group (models whose layers differ), all sharing the rows."""

from __future__ import annotations

import numpy as np


class BlockTable:
    """Rows of physical block ids on the host, kept across steps: [num_groups, rows, width].

    Rows are assigned when a request arrives and released when it leaves, so a step only writes
    the blocks that are new and gathers the rows it schedules: the work per step does not grow
    with how long the requests already are. numpy, not torch: these are tiny host arrays, and
    torch's CPU ops pay thread-pool costs per call that would dominate a decode step.

    Every group's table of a request has the same length (the KV manager grows them together).
    A sliding group's entries before its window may be NULL_BLOCK_ID (-1) or a block it has
    since given back: its layers never read them.
    """

    def __init__(self, max_blocks_per_req: int, initial_rows: int = 64, num_groups: int = 1) -> None:
        self.max_blocks_per_req = max_blocks_per_req
        self.num_groups = num_groups
        self.table = np.zeros((num_groups, initial_rows, max_blocks_per_req), dtype=np.int32)
        self.num_blocks = np.zeros(initial_rows, dtype=np.int64)
        self._free_rows = list(range(initial_rows - 1, -1, -1))

    def add_row(self, block_ids: list[list[int]]) -> int:
        """A row for a new request: block_ids, one list per group."""
        if not self._free_rows:
            self._grow()
        row = self._free_rows.pop()
        self.num_blocks[row] = 0
        self.append(row, block_ids)
        return row

    def append(self, row: int, block_ids: list[list[int]]) -> None:
        """Append each group's new block ids (one list per group, all of one length)."""
        if len(block_ids) != self.num_groups:
            raise ValueError(f"{len(block_ids)} block lists for {self.num_groups} KV-cache groups")
        count = len(block_ids[0])
        if not count:
            return
        start = int(self.num_blocks[row])
        end = start + count
        if end > self.max_blocks_per_req:
            raise ValueError(f"block table row overflow: {end} > {self.max_blocks_per_req} blocks")
        if self.num_groups == 1:
            self.table[0, row, start:end] = block_ids[0]
        else:
            if any(len(ids) != count for ids in block_ids):
                raise ValueError("KV-cache groups' tables grow by different counts")
            self.table[:, row, start:end] = block_ids
        self.num_blocks[row] = end

    def free_row(self, row: int) -> None:
        self._free_rows.append(row)

    def gather(self, rows: np.ndarray) -> np.ndarray:
        """The rows of this step's requests, in step order, cut to the widest one used:
        [num_groups, len(rows), width]."""
        width = max(1, int(self.num_blocks[rows].max())) if len(rows) else 1
        return self.table[:, rows, :width]

    def _grow(self) -> None:
        old = self.table.shape[1]
        self.table = np.concatenate([self.table, np.zeros_like(self.table)], axis=1)
        self.num_blocks = np.concatenate([self.num_blocks, np.zeros_like(self.num_blocks)])
        self._free_rows.extend(range(2 * old - 1, old - 1, -1))
