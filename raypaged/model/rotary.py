"""Rotary position embedding (NeoX / Hugging Face "rotate half" layout) with default, linear and
llama3 frequency scaling, the scalings of rope_scaling.py (yarn, dynamic, longrope, with their
attention factor on cos and sin) and partial rotary (only a head's first dims rotated, Phi-3).

cos/sin are computed per step from the positions instead of looked up in a precomputed
[max_position, head_dim] table: the cost is T·D/2 cosines (negligible next to attention), there is
no table to size against max_position_embeddings, and on the torch path the arithmetic is exactly
Hugging Face's (fp32 `position * inv_freq`, then cast to the activation dtype), so fp32 logits
match it tightly. On the Triton backend (ops; CUDA tensors by default) one kernel computes the
step's cos/sin [T, D/2] once, and every layer's rope (a kernel rotating q and k in place, or the
qkv GEMM's epilogue) reads them.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import nn

from raypaged.kernels import ops

from .config import RopeConfig


def rotary_dim(head_dim: int, rope: RopeConfig) -> int:
    """How many leading dims of each head are rotated."""
    return int(head_dim * rope.partial_rotary_factor)


def rope_inverse_frequencies(head_dim: int, rope: RopeConfig) -> torch.Tensor:
    """[rotary_dim / 2] fp32 inverse frequencies, computed as transformers computes them."""
    dim = rotary_dim(head_dim, rope)
    if rope.scaled is not None:
        return rope.scaled.inverse_frequencies(rope.theta, dim)
    exponents = torch.arange(0, dim, 2, dtype=torch.int64, device="cpu").float() / dim
    inv_freq = 1.0 / (rope.theta**exponents)
    if rope.rope_type == "linear":
        return inv_freq / rope.factor
    if rope.rope_type == "llama3":
        return _llama3_scaled(inv_freq, rope)
    return inv_freq


def _llama3_scaled(inv_freq: torch.Tensor, rope: RopeConfig) -> torch.Tensor:
    # Long wavelengths (low frequencies) are divided by `factor`, short ones kept, and the band in
    # between interpolated smoothly (Llama 3.1's long-context recipe).
    old_context = rope.original_max_position_embeddings
    low_freq_wavelen = old_context / rope.low_freq_factor
    high_freq_wavelen = old_context / rope.high_freq_factor
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_freq_wavelen, inv_freq / rope.factor, inv_freq)
    smooth = (old_context / wavelen - rope.low_freq_factor) / (
        rope.high_freq_factor - rope.low_freq_factor
    )
    smoothed = (1 - smooth) * scaled / rope.factor + smooth * scaled
    is_medium = ~(wavelen < high_freq_wavelen) * ~(wavelen > low_freq_wavelen)
    return torch.where(is_medium, smoothed, scaled)


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


class RotaryEmbedding(nn.Module):
    inv_freq: torch.Tensor  # a buffer (registered below), which nn.Module's typing cannot see

    def __init__(self, head_dim: int, rope: RopeConfig) -> None:
        super().__init__()
        self.head_dim = head_dim
        # transformers multiplies cos and sin by it (yarn's mscale, longrope's scaling).
        self.attention_factor = rope.scaled.attention_factor if rope.scaled else 1.0
        # Not a parameter and not in the checkpoint; kept fp32 whatever the model dtype.
        self.register_buffer(
            "inv_freq", rope_inverse_frequencies(head_dim, rope).to(torch.get_default_device()),
            persistent=False,
        )

    def forward(self, positions: torch.Tensor, dtype: torch.dtype) -> StepRotary:
        """The rotation of this step's tokens, computed once and shared by every layer."""
        scale = self.attention_factor
        if ops.backend_for(positions) == "triton":
            cos, sin = ops.rope_tables(positions, self.inv_freq)
            if scale != 1.0:
                cos, sin = cos * scale, sin * scale
            return StepRotary(cos, sin, on_kernels=True)
        freqs = positions.float()[:, None] * self.inv_freq.float()[None, :]
        angles = torch.cat((freqs, freqs), dim=-1)[:, None, :]
        cos, sin = angles.cos(), angles.sin()
        if scale != 1.0:
            cos, sin = cos * scale, sin * scale
        return StepRotary(cos.to(dtype), sin.to(dtype), on_kernels=False)


@dataclass(frozen=True)
class StepRotary:
    # The kernels' path: [T, R/2] fp32 (ops.rope_tables). The torch path: [T, 1, R] in the
    # activation dtype, transformers' arithmetic. R, the rotary dim, is the head dim unless
    # rotary is partial; then only each head's first R dims are rotated.
    cos: torch.Tensor
    sin: torch.Tensor
    on_kernels: bool

    @property
    def rotary_dim(self) -> int:
        return self.cos.shape[-1] * 2 if self.on_kernels else self.cos.shape[-1]

    def covers(self, head_dim: int) -> bool:
        """Whether it rotates whole heads of `head_dim` (what the fused qkv GEMM's rope does)."""
        return self.rotary_dim == head_dim

    def apply(
        self, query: torch.Tensor, key: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """query [T, Hq, D], key [T, Hkv, D] rotated by their tokens' positions.

        On the fused path they are rotated in place (they are views into the qkv output).
        """
        dim = self.rotary_dim
        if self.on_kernels:
            # The kernel takes views: a partial rotary rotates the leading dims in place.
            ops.rope_in_place(query[..., :dim], key[..., :dim], self.cos, self.sin)
            return query, key
        if dim != query.shape[-1]:
            return self._partial(query, dim), self._partial(key, dim)
        return (
            query * self.cos + _rotate_half(query) * self.sin,
            key * self.cos + _rotate_half(key) * self.sin,
        )

    def _partial(self, x: torch.Tensor, dim: int) -> torch.Tensor:
        rotated, passed = x[..., :dim], x[..., dim:]
        return torch.cat((rotated * self.cos + _rotate_half(rotated) * self.sin, passed), dim=-1)
