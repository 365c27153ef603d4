"""Qwen3 (`Qwen3ForCausalLM`): the Llama decoder with an RMSNorm over each query and key head
(q_norm, k_norm, weights [head_dim]) between the projection and rope.

head_dim is set explicitly in Qwen3 configs and differs from hidden / heads; q/k/v (and o_proj)
biases follow `attention_bias` as in Llama. Under tensor parallelism the heads are split and the
per-head norm weights are replicated on every rank.
"""

from __future__ import annotations

import torch

from .config import ModelConfig
from .layers import RMSNorm
from .llama import CheckpointTarget, LlamaAttention, LlamaForCausalLM
from .rotary import StepRotary


class Qwen3Attention(LlamaAttention):
    def __init__(self, config: ModelConfig, layer: int = 0) -> None:
        super().__init__(config, layer)
        self.q_norm = RMSNorm(config.head_dim, config.rms_norm_eps)
        self.k_norm = RMSNorm(config.head_dim, config.rms_norm_eps)

    def qkv(
        self, rope: StepRotary, hidden: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """hidden [T, H] -> q [T, Hq, D], k, v [T, Hkv, D]: q and k normalised per head, then
        rotated (so never through the GEMM that rotates as it stores)."""
        q, k, v = self.qkv_proj.split(self.qkv_proj(hidden))
        q, k = _norm_heads(self.q_norm, q), _norm_heads(self.k_norm, k)
        q, k = rope.apply(q, k)
        return q, k, v


def _norm_heads(norm: RMSNorm, x: torch.Tensor) -> torch.Tensor:
    # [T, heads, D] (a strided view into the qkv output) -> every head normalised over D.
    tokens, heads, dim = x.shape
    return norm(x.reshape(tokens * heads, dim)).view(tokens, heads, dim)


class Qwen3ForCausalLM(LlamaForCausalLM):
    attention_class = Qwen3Attention

    def checkpoint_tensors(self) -> dict[str, CheckpointTarget]:
        targets = super().checkpoint_tensors()
        for i, layer in enumerate(self.model.layers):
            for norm in ("q_norm", "k_norm"):
                targets[f"model.layers.{i}.self_attn.{norm}.weight"] = CheckpointTarget(
                    getattr(layer.self_attn, norm), "weight"
                )
        return targets
