"""The loader's part of FP8: which layers are quantized, the checkpoint tensors they add, and
what is done once the weights are in.

A `QuantizationPlan` is made after the decoder is built and before any weight is read:
- quantize at load: the layers load their float weights as usual; `finish()` then quantizes each
  to e4m3 with one scale per output row. A column-parallel rank holds whole rows, so its scales
  are its rows' own; a row-parallel rank holds a slice of every row, so the rows' maxima are
  all-reduced (MAX) over the TP group first, and every rank's scales — and so its e4m3 values —
  are those TP 1 computes for the same rows.
- an FP8 checkpoint: each quantized layer's weight becomes an e4m3 tensor of its shape, which its
  own load_weight fills (rows or columns of this rank); `<proj>.weight_scale` shards like the
  layer's bias (column-parallel: with the rows; row-parallel: every rank keeps all of them), and
  a per-tensor scale is spread over the rows of its part, so a merged qkv / gate_up whose parts
  were scaled differently keeps each part's scale exactly; `<proj>.input_scale` (static
  activations) is one per part, and the merged layer takes their maximum (its input is one
  tensor: the larger scale saturates none of the parts' inputs).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
from torch import nn

from ..fused_weights import FusedRows
from ..layers import ColumnParallelLinear, RowParallelLinear, TensorSource, WeightShapeError
from ..llama import CheckpointTarget, LlamaForCausalLM
from ..parallel import get_tp_size, tp_all_reduce
from .fp8 import Fp8Linear, check_shape
from .numerics import FP8_DTYPE, per_channel_amax, quantize_weight
from .schemes import Fp8Scheme, QuantizationError

logger = logging.getLogger(__name__)

Linear = ColumnParallelLinear | RowParallelLinear
FP8_CHECKPOINT_DTYPES = ("F8_E4M3",)
SCALE_CHECKPOINT_DTYPES = ("F32", "BF16", "F16")
# Tensors FP8 checkpoints carry for an FP8 KV cache: model/kv_scales.py reads those it knows
# when the pool is FP8; the rest are not needed.
KV_SCALE_SUFFIXES = (".k_scale", ".v_scale", ".kv_scale")


@dataclass
class QuantizedLayer:
    layer: Linear
    method: Fp8Linear
    # (checkpoint module name, the layer's shard id) per checkpoint tensor; a fused tensor
    # (Phi-3's qkv_proj) has the tuple of the shards it stacks
    parts: list[tuple[str, object]]
    input_scales: torch.Tensor | None = None  # static activations: one per part, until finish()


@dataclass
class QuantizationPlan:
    scheme: Fp8Scheme
    layers: list[QuantizedLayer]
    targets: dict[str, CheckpointTarget] = field(default_factory=dict)  # the scales' tensors
    dtypes: dict[str, tuple[str, ...]] = field(default_factory=dict)  # checkpoint dtypes they may have
    ignored_suffixes: tuple[str, ...] = ()

    def finish(self) -> None:
        """After every tensor is loaded: quantize float weights, or settle the scales read."""
        for q in self.layers:
            if not self.scheme.from_checkpoint:
                _quantize_at_load(q.layer, q.method)
                continue
            names = ", ".join(name for name, _ in q.parts)
            if not torch.isfinite(q.method.weight_scale).all() or (q.method.weight_scale <= 0).any():
                raise QuantizationError(f"the weight_scale of {names} has values that are not positive and finite")
            if q.input_scales is not None:
                assert q.method.input_scale is not None
                if not torch.isfinite(q.input_scales).all() or (q.input_scales <= 0).any():
                    raise QuantizationError(f"the input_scale of {names} is not positive and finite")
                q.method.input_scale.copy_(q.input_scales.max().reshape(1))


def plan_quantization(model: LlamaForCausalLM, scheme: Fp8Scheme, device: torch.device) -> QuantizationPlan:
    """Give the quantized layers their Fp8Linear (and, from an FP8 checkpoint, e4m3 weights and
    the targets of their scales), before the weights are loaded."""
    plan = QuantizationPlan(scheme, [])
    if scheme.from_checkpoint:
        plan.ignored_suffixes = KV_SCALE_SUFFIXES
    for layer, parts in _linears(model).items():
        flags = {scheme.quantizes(name) for name, _ in parts}
        if len(flags) > 1:
            raise QuantizationError(
                f"{', '.join(n for n, _ in parts)} are one GEMM here, but the checkpoint quantizes "
                "only some of them"
            )
        if not flags.pop():
            continue
        out_features, in_features = layer.weight.shape
        check_shape(parts[0][0], out_features, in_features, device)
        method = Fp8Linear(out_features, scheme.activation, device=device)
        layer.quant = method
        q = QuantizedLayer(layer, method, parts)
        plan.layers.append(q)
        if not scheme.from_checkpoint:
            continue
        layer.weight = nn.Parameter(torch.empty(out_features, in_features, dtype=FP8_DTYPE, device=device),
                                    requires_grad=False)
        if scheme.static_input_scale:
            q.input_scales = torch.zeros(len(parts), dtype=torch.float32, device=device)
        for index, (name, shard) in enumerate(parts):
            plan.dtypes[f"{name}.weight"] = FP8_CHECKPOINT_DTYPES
            plan.targets[f"{name}.weight_scale"] = _scale_target(layer, method, scheme.weight_strategy, shard)
            plan.dtypes[f"{name}.weight_scale"] = SCALE_CHECKPOINT_DTYPES
            if q.input_scales is not None:
                plan.targets[f"{name}.input_scale"] = CheckpointTarget(_InputScale(q), "input_scale", index)
                plan.dtypes[f"{name}.input_scale"] = SCALE_CHECKPOINT_DTYPES
    if not plan.layers:
        raise QuantizationError(f"the {scheme.source} FP8 scheme quantizes none of this model's linear layers")
    return plan


def _linears(model: LlamaForCausalLM) -> dict[Linear, list[tuple[str, object]]]:
    """Each TP linear layer -> the checkpoint modules merged into it, from the model's own map
    of checkpoint names (so it holds for every decoder that uses these layers, fused checkpoint
    tensors included)."""
    layers: dict[Linear, list[tuple[str, object]]] = {}
    for name, target in model.checkpoint_tensors().items():
        if target.param != "weight":
            continue
        module: object = target.module
        shard = target.shard
        if isinstance(target.module, FusedRows):
            module, shard = target.module.module, tuple(target.module.parts)
        if isinstance(module, ColumnParallelLinear | RowParallelLinear):
            layers.setdefault(module, []).append((name.removesuffix(".weight"), shard))
    return layers


def _scale_target(layer: Linear, method: Fp8Linear, strategy: str, shard: object) -> CheckpointTarget:
    """Where `<proj>.weight_scale` loads. A fused tensor's per-channel scales are split by rows
    like its weight (FusedRows); its one per-tensor scale covers all of its parts' rows."""
    scales = _WeightScale(layer, method, strategy)
    if isinstance(shard, tuple) and strategy == "channel":
        return CheckpointTarget(FusedRows(scales, shard), "weight_scale")
    return CheckpointTarget(scales, "weight_scale", shard)


def _quantize_at_load(layer: Linear, method: Fp8Linear) -> None:
    weight = layer.weight.data
    amax = per_channel_amax(weight)
    if isinstance(layer, RowParallelLinear) and get_tp_size() > 1:
        tp_all_reduce(amax, op=dist.ReduceOp.MAX)
    quantized, scale = quantize_weight(weight, amax)
    layer.weight = nn.Parameter(quantized, requires_grad=False)
    method.weight_scale.copy_(scale)


def _scalar(source: TensorSource) -> torch.Tensor:
    value = source.read()
    if value.numel() != 1:
        raise WeightShapeError(f"tensor {source.name!r} has shape {tuple(source.shape)}, expected one value")
    return value.reshape(()).float()


class _WeightScale:
    """Loads `<proj>.weight_scale` into the layer's Fp8Linear: [full rows, 1] per channel, one
    value per tensor."""

    def __init__(self, layer: Linear, method: Fp8Linear, strategy: str) -> None:
        self.layer, self.method, self.strategy = layer, method, strategy

    def _rows(self, shard: object) -> list[tuple[int, int, int]]:
        """(first checkpoint row read, rows, first row written) of this rank, per part."""
        if isinstance(self.layer, ColumnParallelLinear):
            shards = [self.layer.output_shard(part) for part in (shard if isinstance(shard, tuple) else (shard,))]
            return [(s.source_start, s.rows, s.dest_start) for s in shards]
        return [(0, self.layer.weight.shape[0], 0)]  # row-parallel: every rank has every output row

    def checkpoint_shape(self, param: str, shard: object = None) -> tuple[int, ...]:
        if self.strategy == "tensor":
            return (1,)
        if isinstance(self.layer, ColumnParallelLinear):
            return (self.layer.output_shard(shard).full_rows, 1)
        return (self.layer.weight.shape[0], 1)

    def load_weight(self, param: str, shard: object, source: TensorSource) -> None:
        value = _scalar(source) if self.strategy == "tensor" else None
        for start, rows, dest in self._rows(shard):
            target = self.method.weight_scale[dest : dest + rows]
            if value is not None:
                target.fill_(value)
            else:
                target.copy_(source.read(rows=slice(start, start + rows)).reshape(-1))


class _InputScale:
    """Loads one part's static `<proj>.input_scale` (a single value)."""

    def __init__(self, q: QuantizedLayer) -> None:
        self.q = q

    def checkpoint_shape(self, param: str, shard: object = None) -> tuple[int, ...]:
        return (1,)

    def load_weight(self, param: str, shard: object, source: TensorSource) -> None:
        assert self.q.input_scales is not None and isinstance(shard, int)
        self.q.input_scales[shard] = _scalar(source)
