"""The pieces Gemma 2 / 3 do differently from Llama: RMSNorm scaled by (1 + weight), embeddings
scaled by √hidden, GeGLU (tanh GELU), and (Gemma 3) two ropes, one for the local layers and one
for the global ones.
"""

from __future__ import annotations

import torch
from torch import nn

from raypaged.kernels import ops

from .config import RopeConfig
from .layers import MergedColumnParallelLinear, RMSNorm, RowParallelLinear, VocabParallelEmbedding
from .llama import LlamaMLP
from .rotary import RotaryEmbedding, StepRotary


class GemmaRMSNorm(RMSNorm):
    """x / rms(x) · (1 + weight), all in fp32 and rounded once (transformers' Gemma2RMSNorm; the
    checkpoint stores weight - 1), one kernel (ops.rms_norm's unit_offset). Loads like RMSNorm;
    over the last dim of any shape (a [T, heads, D] view of the qkv output: each head)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        rows = x.reshape(-1, x.shape[-1])
        return ops.rms_norm(rows, self.weight, self.eps, unit_offset=True).view(x.shape)

    def add_and_norm(
        self, x: torch.Tensor, residual: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        return ops.add_rms_norm(x, residual, self.weight, self.eps, unit_offset=True)


class ScaledEmbedding(VocabParallelEmbedding):
    """The vocab-parallel embedding times √hidden, the factor rounded to the model dtype first
    as transformers does (√3072 is 55.5 in bf16)."""

    normalizer: torch.Tensor  # a buffer (registered below)

    def __init__(self, vocab_size: int, hidden_size: int) -> None:
        super().__init__(vocab_size, hidden_size)
        scale = torch.tensor(hidden_size**0.5, dtype=torch.float32).to(self.weight.dtype)
        self.register_buffer("normalizer", scale.to(self.weight.device), persistent=False)

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        return super().forward(input_ids) * self.normalizer


class GeGLUMLP(LlamaMLP):
    """down(gelu_tanh(gate(x)) * up(x)), gate and up in one column-parallel GEMM."""

    def __init__(self, hidden_size: int, intermediate_size: int, bias: bool = False) -> None:
        nn.Module.__init__(self)  # its own modules: the Llama parent is the interface only
        self.gate_up_proj = MergedColumnParallelLinear(
            hidden_size, [intermediate_size, intermediate_size], bias=bias
        )
        self.down_proj = RowParallelLinear(intermediate_size, hidden_size, bias=bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(ops.gelu_tanh_and_mul(self.gate_up_proj(x)))


class LocalGlobalRotary(RotaryEmbedding):
    """Two ropes computed once a step as one StepRotary, the local layers' tables then the
    global layers' (this module's own frequencies) side by side in the last dim, so the
    piecewise graphs' one rope buffer holds both; each layer takes its half with `select`."""

    def __init__(self, head_dim: int, local: RopeConfig, full: RopeConfig) -> None:
        super().__init__(head_dim, full)
        self.local = RotaryEmbedding(head_dim, local)

    def forward(self, positions: torch.Tensor, dtype: torch.dtype) -> StepRotary:
        local, full = self.local(positions, dtype), super().forward(positions, dtype)
        return StepRotary(torch.cat((local.cos, full.cos), -1), torch.cat((local.sin, full.sin), -1),
                          on_kernels=local.on_kernels)

    @staticmethod
    def select(rope: StepRotary, local: bool) -> StepRotary:
        """The local (or global) half of `forward`'s result, contiguous for the rope kernels."""
        half = rope.cos.shape[-1] // 2
        part = slice(0, half) if local else slice(half, None)
        return StepRotary(rope.cos[..., part].contiguous(), rope.sin[..., part].contiguous(),
                          rope.on_kernels)
