"""The persistent block table: one row per request the worker holds, updated by diffs."""

from __future__ import annotations

import numpy as np


class BlockTable:
    """Rows of physical block ids on the host, kept across steps.

    Rows are assigned when a request arrives and released when it leaves, so a step only writes
    the blocks that are new and gathers the rows it schedules: the work per step does not grow
    with how long the requests already are. numpy, not torch: these are tiny host arrays, and
    torch's CPU ops pay thread-pool costs per call that would dominate a decode step.
    """

    def __init__(self, max_blocks_per_req: int, initial_rows: int = 64) -> None:
        self.max_blocks_per_req = max_blocks_per_req
        self.table = np.zeros((initial_rows, max_blocks_per_req), dtype=np.int32)
        self.num_blocks = np.zeros(initial_rows, dtype=np.int64)
        self._free_rows = list(range(initial_rows - 1, -1, -1))

    def add_row(self, block_ids: list[int]) -> int:
        if not self._free_rows:
            self._grow()
        row = self._free_rows.pop()
        self.num_blocks[row] = 0
        self.append(row, block_ids)
        return row

    def append(self, row: int, block_ids: list[int]) -> None:
        if not block_ids:
            return
        start = int(self.num_blocks[row])
        end = start + len(block_ids)
        if end > self.max_blocks_per_req:
            raise ValueError(f"block table row overflow: {end} > {self.max_blocks_per_req} blocks")
        self.table[row, start:end] = block_ids
        self.num_blocks[row] = end

    def free_row(self, row: int) -> None:
        self._free_rows.append(row)

    def gather(self, rows: np.ndarray) -> np.ndarray:
        """The rows of this step's requests, in step order, cut to the widest one used."""
        width = max(1, int(self.num_blocks[rows].max())) if len(rows) else 1
        return self.table[rows, :width]

    def _grow(self) -> None:
        old = self.table.shape[0]
        self.table = np.concatenate([self.table, np.zeros_like(self.table)])
        self.num_blocks = np.concatenate([self.num_blocks, np.zeros_like(self.num_blocks)])
        self._free_rows.extend(range(2 * old - 1, old - 1, -1))
