"""Tensor-parallel building blocks: RMSNorm, column/row-parallel linears (with merged QKV and
gate/up variants), vocab-parallel embedding and LM head.

Each layer knows how it is sharded, so each one also loads itself from a checkpoint tensor:
`checkpoint_shape(param, shard)` is the full tensor's shape in the checkpoint and
`load_weight(param, shard, source)` reads from `source` only the rows/columns this rank keeps.
At tp = 1 every layer is a plain nn.Linear / nn.Embedding and the collectives are no-ops.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol, cast

import torch
import torch.nn.functional as F
from torch import nn

from raypaged.kernels import ops

from .parallel import get_tp_rank, get_tp_size, tp_all_gather, tp_all_reduce
from .quantization.base import LinearMethod


class TensorSource(Protocol):
    """A checkpoint tensor that can be read in part (safetensors slice, or a generated tensor)."""

    name: str
    shape: tuple[int, ...]

    def read(self, rows: slice | None = None, cols: slice | None = None) -> torch.Tensor: ...


class LoadsWeights(Protocol):
    """A module that fills its own parameters (this TP rank's part) from checkpoint tensors."""

    def checkpoint_shape(self, param: str, shard: object = None) -> tuple[int, ...]: ...

    def load_weight(self, param: str, shard: object, source: TensorSource) -> None: ...


class WeightShapeError(ValueError):
    """A checkpoint tensor's shape differs from what the config implies."""


def _check_shape(source: TensorSource, expected: tuple[int, ...]) -> None:
    if tuple(source.shape) != tuple(expected):
        raise WeightShapeError(
            f"tensor {source.name!r} has shape {tuple(source.shape)}, expected {tuple(expected)} "
            "from config.json"
        )


def _divide(numerator: int, denominator: int, what: str) -> int:
    if numerator % denominator:
        raise ValueError(f"{what} {numerator} is not divisible by tensor-parallel size {denominator}")
    return numerator // denominator


class RMSNorm(nn.Module):
    """Replicated on every rank. Normalises in fp32 and casts back, as transformers does."""

    def __init__(self, hidden_size: int, eps: float) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.empty(hidden_size), requires_grad=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return ops.rms_norm(x, self.weight, self.eps)

    def add_and_norm(
        self, x: torch.Tensor, residual: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(norm(x + residual), x + residual): the pre-norm decoder's residual step."""
        return ops.add_rms_norm(x, residual, self.weight, self.eps)

    def checkpoint_shape(self, param: str, shard: object = None) -> tuple[int, ...]:
        return tuple(self.weight.shape)

    def load_weight(self, param: str, shard: object, source: TensorSource) -> None:
        _check_shape(source, self.checkpoint_shape(param))
        self.weight.data.copy_(source.read())


@dataclass(frozen=True)
class OutputShard:
    """One logical output block of a column-parallel weight (e.g. the k of a merged qkv)."""

    full_rows: int  # rows in the checkpoint tensor
    source_start: int  # first checkpoint row this rank keeps
    rows: int  # rows this rank keeps
    dest_start: int  # where they go in this rank's merged weight


class ColumnParallelLinear(nn.Module):
    """y = x Wᵀ (+ b) with W's output rows split over ranks; the output stays split.

    Several checkpoint tensors may be merged into one weight (`output_sizes`, loaded by shard
    index), so one GEMM serves e.g. gate_proj and up_proj.
    """

    def __init__(self, input_size: int, output_sizes: list[int], bias: bool) -> None:
        super().__init__()
        tp, rank = get_tp_size(), get_tp_rank()
        shards, dest = [], 0
        for size in output_sizes:
            rows = _divide(size, tp, "output size")
            shards.append(OutputShard(size, rank * rows, rows, dest))
            dest += rows
        self._init(input_size, shards, bias)

    def _init(self, input_size: int, shards: list[OutputShard], bias: bool) -> None:
        self.input_size = input_size
        self.shards = shards
        rows = sum(s.rows for s in shards)
        self.weight = nn.Parameter(torch.empty(rows, input_size), requires_grad=False)
        self.bias = nn.Parameter(torch.empty(rows), requires_grad=False) if bias else None
        # Set by model/quantization when the weight is quantized: it then computes the product.
        self.quant: LinearMethod | None = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.quant is not None:
            return self.quant.matmul(x, self.weight, self.bias)
        return ops.linear(x, self.weight, self.bias)

    def _shard(self, shard: object) -> OutputShard:
        return self.shards[0 if shard is None else cast(int, shard)]  # this class's shard ids: indices

    def output_shard(self, shard: object) -> OutputShard:
        """Where checkpoint tensor `shard` (index, or "q"/"k"/"v") lands in this rank's rows."""
        return self._shard(shard)

    def checkpoint_shape(self, param: str, shard: object = None) -> tuple[int, ...]:
        rows = self._shard(shard).full_rows
        return (rows, self.input_size) if param == "weight" else (rows,)

    def load_weight(self, param: str, shard: object, source: TensorSource) -> None:
        _check_shape(source, self.checkpoint_shape(param, shard))
        s = self._shard(shard)
        target = self.weight if param == "weight" else self.bias
        assert target is not None
        target.data[s.dest_start : s.dest_start + s.rows].copy_(
            source.read(rows=slice(s.source_start, s.source_start + s.rows))
        )


class MergedColumnParallelLinear(ColumnParallelLinear):
    """gate_proj and up_proj as one column-parallel GEMM; shards 0 and 1."""

    def silu_and_mul(self, x: torch.Tensor) -> torch.Tensor:
        """silu(gate) * up of x's product [T, I]: the skinny GEMM applies it as it stores its
        outputs where it takes the product, else a separate kernel does."""
        if self.quant is not None:
            activated = self.quant.matmul_silu_mul(x, self.weight, self.bias)
        else:
            activated = ops.linear_silu_mul(x, self.weight, self.bias)
        if activated is not None:
            return activated
        return ops.silu_and_mul(self(x))


class QKVParallelLinear(ColumnParallelLinear):
    """q, k and v projections as one column-parallel GEMM; shards "q", "k", "v".

    Query heads split evenly over ranks. KV heads split evenly when there are at least as many as
    ranks; otherwise each rank keeps the single KV head its query heads attend with (replicated
    across tp / num_kv_heads ranks).
    """

    SHARD_NAMES = ("q", "k", "v")

    def __init__(
        self, hidden_size: int, head_dim: int, num_heads: int, num_kv_heads: int, bias: bool
    ) -> None:
        nn.Module.__init__(self)
        tp, rank = get_tp_size(), get_tp_rank()
        self.num_heads = _divide(num_heads, tp, "num_attention_heads")
        if num_kv_heads >= tp:
            self.num_kv_heads = _divide(num_kv_heads, tp, "num_key_value_heads")
        elif tp % num_kv_heads:
            raise ValueError(
                f"tensor-parallel size {tp} is not a multiple of num_key_value_heads {num_kv_heads}"
            )
        else:
            self.num_kv_heads = 1
        # Query head h uses KV head h // (num_heads / num_kv_heads); rank r's first query head is
        # r·num_heads/tp, so its KV head is r·num_kv_heads // tp in both cases above.
        kv_start = rank * num_kv_heads // tp
        q_rows, kv_rows = self.num_heads * head_dim, self.num_kv_heads * head_dim
        self.head_dim = head_dim
        self._init(
            hidden_size,
            [
                OutputShard(num_heads * head_dim, rank * q_rows, q_rows, 0),
                OutputShard(num_kv_heads * head_dim, kv_start * head_dim, kv_rows, q_rows),
                OutputShard(num_kv_heads * head_dim, kv_start * head_dim, kv_rows, q_rows + kv_rows),
            ],
            bias,
        )

    def _shard(self, shard: object) -> OutputShard:
        return self.shards[self.SHARD_NAMES.index(shard)]

    def rotated(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor | None:
        """x's product with q and k rotated by rope (the step's cos/sin [T, D/2]) as the skinny
        GEMM stores them, or None where that kernel does not take the product."""
        if self.quant is not None:
            return self.quant.matmul_rope(x, self.weight, self.bias, cos, sin, self.head_dim,
                                         (self.num_heads + self.num_kv_heads) * self.head_dim)
        return ops.linear_rope(x, self.weight, self.bias, cos, sin, self.head_dim,
                               (self.num_heads + self.num_kv_heads) * self.head_dim)

    def split(self, qkv: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """[T, rows] -> q [T, Hq, D], k [T, Hkv, D], v [T, Hkv, D] (this rank's heads)."""
        q_rows, kv_rows = self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim
        q, k, v = qkv.split([q_rows, kv_rows, kv_rows], dim=-1)
        t = qkv.shape[0]
        return (
            q.reshape(t, self.num_heads, self.head_dim),
            k.reshape(t, self.num_kv_heads, self.head_dim),
            v.reshape(t, self.num_kv_heads, self.head_dim),
        )


class RowParallelLinear(nn.Module):
    """y = x Wᵀ + b with W's input columns split over ranks; partial sums are all-reduced.

    The input arrives already split (the output of a column-parallel layer). The bias is added
    once, after the reduction.
    """

    def __init__(self, input_size: int, output_size: int, bias: bool) -> None:
        super().__init__()
        tp, rank = get_tp_size(), get_tp_rank()
        self.tp = tp
        self.full_input_size = input_size
        self.cols = _divide(input_size, tp, "input size")
        self.col_start = rank * self.cols
        self.weight = nn.Parameter(torch.empty(output_size, self.cols), requires_grad=False)
        self.bias = nn.Parameter(torch.empty(output_size), requires_grad=False) if bias else None
        # Set by model/quantization when the weight is quantized: it then computes the product.
        self.quant: LinearMethod | None = None

    def _product(self, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        if self.quant is not None:
            return self.quant.matmul(x, self.weight, bias)
        return ops.linear(x, self.weight, bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.tp == 1:
            return self._product(x, self.bias)
        out = tp_all_reduce(self._product(x, None))
        return out if self.bias is None else out + self.bias

    def checkpoint_shape(self, param: str, shard: object = None) -> tuple[int, ...]:
        out = self.weight.shape[0]
        return (out, self.full_input_size) if param == "weight" else (out,)

    def load_weight(self, param: str, shard: object, source: TensorSource) -> None:
        _check_shape(source, self.checkpoint_shape(param))
        if param == "weight":
            self.weight.data.copy_(source.read(cols=slice(self.col_start, self.col_start + self.cols)))
        else:
            assert self.bias is not None
            self.bias.data.copy_(source.read())


class VocabParallelEmbedding(nn.Module):
    """Embedding whose vocabulary rows are split over ranks (padded to a multiple of tp).

    Each rank looks up the ids in its range, zeros the rest, and the ranks' results are summed.
    """

    def __init__(self, vocab_size: int, hidden_size: int) -> None:
        super().__init__()
        tp, rank = get_tp_size(), get_tp_rank()
        self.tp = tp
        self.vocab_size = vocab_size
        self.rows = -(-vocab_size // tp)
        self.vocab_start = rank * self.rows
        # Rows past the real vocabulary (the padding on the last ranks) stay zero.
        self.valid_rows = max(0, min(self.rows, vocab_size - self.vocab_start))
        self.weight = nn.Parameter(torch.empty(self.rows, hidden_size), requires_grad=False)

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        if self.tp == 1:
            return F.embedding(input_ids, self.weight)
        local = input_ids - self.vocab_start
        in_range = (local >= 0) & (local < self.rows)
        out = F.embedding(local.clamp(0, self.rows - 1), self.weight)
        out = out * in_range.unsqueeze(-1).to(out.dtype)
        return tp_all_reduce(out)

    def checkpoint_shape(self, param: str, shard: object = None) -> tuple[int, ...]:
        return (self.vocab_size, self.weight.shape[1])

    def load_weight(self, param: str, shard: object, source: TensorSource) -> None:
        _check_shape(source, self.checkpoint_shape(param))
        self.weight.data[self.valid_rows :].zero_()
        self.weight.data[: self.valid_rows].copy_(
            source.read(rows=slice(self.vocab_start, self.vocab_start + self.valid_rows))
        )


class ParallelLMHead(VocabParallelEmbedding):
    """hidden -> logits over the full vocabulary: each rank scores its vocab rows, then the
    pieces are gathered and the padding cut off."""

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        logits = ops.linear(hidden, self.weight)
        return tp_all_gather(logits, dim=-1)[..., : self.vocab_size]
