"""The seam between a linear layer and how it multiplies: a `LinearMethod`.

An unquantized layer has none and runs ops.linear on its weight. A quantized layer keeps its
quantized weight as its `weight` (so TP sharding and the loader treat it as usual) and a method
as its submodule `quant`, which holds what else the product needs (scales, as buffers: they move
with the model and CUDA graphs see them like any tensor) and computes it.
"""

from __future__ import annotations

from abc import ABC, abstractmethod

import torch
from torch import nn


class LinearMethod(nn.Module, ABC):
    """How a layer computes x Wᵀ (+ b) from its quantized weight."""

    @abstractmethod
    def matmul(self, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        """x [T, K] -> [T, N] in x's dtype; weight [N, K] is the layer's quantized weight."""

    def matmul_silu_mul(self, x: torch.Tensor, weight: torch.Tensor,
                       bias: torch.Tensor | None) -> torch.Tensor | None:
        """silu(gate) * up fused into the product with a [gate | up] weight, or None where this
        method has no such kernel (the layer then runs `matmul` and the separate activation)."""
        return None

    def matmul_rope(self, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                   cos: torch.Tensor, sin: torch.Tensor, head_dim: int,
                   rotated_features: int) -> torch.Tensor | None:
        """The qkv product with rope in the epilogue, or None (see ops.linear_rope)."""
        return None
