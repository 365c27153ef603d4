"""Checkpoint tensors that hold several of our shards stacked by rows (Phi-3's qkv_proj and
gate_up_proj), loaded into a column-parallel layer that keeps those shards separately.

`FusedRows` is the loading target of such a tensor: it presents each part (q, k, v; gate, up)
to the layer as a tensor of its own, a row window into the fused one, so the layer reads exactly
the rows its rank keeps of each part, as it does for unfused checkpoints. No rank reads the whole
fused tensor.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from .layers import LoadsWeights, TensorSource, _check_shape


class RowWindow:
    """Rows [start, start + rows) of a checkpoint tensor, as a tensor of its own."""

    def __init__(self, source: TensorSource, start: int, rows: int, part: object) -> None:
        self.name = f"{source.name}[{part}]"
        self.shape = (rows, *source.shape[1:])
        self._source = source
        self._start = start

    def read(self, rows: slice | None = None, cols: slice | None = None) -> torch.Tensor:
        if cols is not None:
            raise ValueError(f"{self.name}: a fused tensor is split by rows only")
        first = 0 if rows is None else rows.start
        stop = self.shape[0] if rows is None else rows.stop
        return self._source.read(rows=slice(self._start + first, self._start + stop))


@dataclass(frozen=True)
class FusedRows:
    """Loads one fused tensor into `module`'s shards `parts`, stacked in that order."""

    module: LoadsWeights
    parts: Sequence[object]

    def checkpoint_shape(self, param: str, shard: object = None) -> tuple[int, ...]:
        shapes = [self.module.checkpoint_shape(param, part) for part in self.parts]
        return (sum(s[0] for s in shapes), *shapes[0][1:])

    def load_weight(self, param: str, shard: object, source: TensorSource) -> None:
        _check_shape(source, self.checkpoint_shape(param))
        start = 0
        for part in self.parts:
            rows = self.module.checkpoint_shape(param, part)[0]
            self.module.load_weight(param, part, RowWindow(source, start, rows, part))
            start += rows
