"""Gemma 2 and Gemma 3 (text): the Llama-family decoder's interface with Gemma's arithmetic.

Per layer: RMSNorm (1 + weight) before and after attention and before and after the GeGLU MLP;
attention scaled by query_pre_attn_scalar^-0.5, its scores soft-capped (Gemma 2), sliding-window
attention on the local layers (Gemma 2: alternate layers; Gemma 3: five of every six, with
their own rope base), q/k RMSNorm per head before rope (Gemma 3). Embeddings are scaled by
√hidden, the final logits soft-capped (Gemma 2). config.json's fields are read by
gemma_config.py.

The classes subclass the Llama ones for their interface (pre_attention / attention /
post_attention / final_norm, which the piecewise CUDA graphs drive, and the loader's
checkpoint_tensors), not for their construction: each builds its own modules.
"""

from __future__ import annotations

import torch
from torch import nn

from .attention import PagedAttention
from .config import ModelConfig
from .gemma_layers import GeGLUMLP, GemmaRMSNorm, LocalGlobalRotary, ScaledEmbedding
from .layers import ParallelLMHead, QKVParallelLinear, RowParallelLinear
from .llama import LlamaAttention, LlamaDecoderLayer, LlamaForCausalLM, LlamaModel
from .parallel import get_tp_size
from .rotary import RotaryEmbedding, StepRotary

_NORMS = ("input_layernorm", "post_attention_layernorm", "pre_feedforward_layernorm",
          "post_feedforward_layernorm")


class GemmaAttention(LlamaAttention):
    def __init__(self, config: ModelConfig, layer: int, two_ropes: bool) -> None:
        nn.Module.__init__(self)  # its own modules: the Llama parent is the interface only
        self.two_ropes = two_ropes  # Gemma 3: two ropes, q/k norms
        self.qkv_proj = QKVParallelLinear(config.hidden_size, config.head_dim,
                                          config.num_attention_heads, config.num_key_value_heads,
                                          bias=config.qkv_bias)
        self.o_proj = RowParallelLinear(config.num_attention_heads * config.head_dim,
                                        config.hidden_size, bias=config.o_proj_bias)
        self.is_local = config.window_of(layer) is not None
        self.attn = PagedAttention(self.qkv_proj.num_heads, self.qkv_proj.num_kv_heads,
                                   config.head_dim, scale=config.attention_scale,
                                   sliding_window=config.window_of(layer),
                                   softcap=config.attn_logit_softcapping)
        self.q_norm = GemmaRMSNorm(config.head_dim, config.rms_norm_eps) if two_ropes else None
        self.k_norm = GemmaRMSNorm(config.head_dim, config.rms_norm_eps) if two_ropes else None

    def qkv(self, rope: StepRotary, hidden: torch.Tensor
            ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """hidden [T, H] -> q [T, Hq, D], k, v [T, Hkv, D]: q and k normed (Gemma 3), rotated
        (Gemma 3: by this layer's half of the step's LocalGlobalRotary)."""
        if self.two_ropes:
            rope = LocalGlobalRotary.select(rope, self.is_local)
        if self.q_norm is None or self.k_norm is None:
            if rope.on_kernels:  # no norm between the GEMM and rope: the GEMM may rotate
                qkv = self.qkv_proj.rotated(hidden, rope.cos, rope.sin)
                if qkv is not None:
                    return self.qkv_proj.split(qkv)
            q, k, v = self.qkv_proj.split(self.qkv_proj(hidden))
        else:
            q, k, v = self.qkv_proj.split(self.qkv_proj(hidden))
            q, k = self.q_norm(q), self.k_norm(k)
        q, k = rope.apply(q, k)
        return q, k, v


class GemmaDecoderLayer(LlamaDecoderLayer):
    """Llama's pre_attention (add & input norm, qkv); Gemma's post_attention."""

    def __init__(self, config: ModelConfig, layer: int, two_ropes: bool) -> None:
        nn.Module.__init__(self)  # its own modules: the Llama parent is the interface only
        self.self_attn = GemmaAttention(config, layer, two_ropes)
        self.mlp = GeGLUMLP(config.hidden_size, config.intermediate_size, bias=config.mlp_bias)
        size, eps = config.hidden_size, config.rms_norm_eps
        self.input_layernorm = GemmaRMSNorm(size, eps)
        self.post_attention_layernorm = GemmaRMSNorm(size, eps)
        self.pre_feedforward_layernorm = GemmaRMSNorm(size, eps)
        self.post_feedforward_layernorm = GemmaRMSNorm(size, eps)

    def post_attention(
        self, attn_out: torch.Tensor, residual: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """attention output [T, Hq·D] -> (this layer's output, residual stream): the output is
        post-normed before each residual add, the MLP's input pre-normed."""
        hidden = self.post_attention_layernorm(self.self_attn.o_proj(attn_out))
        hidden, residual = self.pre_feedforward_layernorm.add_and_norm(hidden, residual)
        return self.post_feedforward_layernorm(self.mlp(hidden)), residual


class GemmaModel(LlamaModel):
    """LlamaModel's forward and building blocks over Gemma's layers (see the module docstring)."""

    def __init__(self, config: ModelConfig) -> None:
        nn.Module.__init__(self)  # its own modules: the Llama parent is the interface only
        two_ropes = config.local_rope is not None
        self.embed_tokens = ScaledEmbedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(
            GemmaDecoderLayer(config, i, two_ropes) for i in range(config.num_hidden_layers))
        self.norm = GemmaRMSNorm(config.hidden_size, config.rms_norm_eps)
        self.rotary_emb = (
            LocalGlobalRotary(config.head_dim, config.local_rope, config.rope)
            if config.local_rope is not None else RotaryEmbedding(config.head_dim, config.rope))


class Gemma2ForCausalLM(LlamaForCausalLM):
    LAYER_NORMS = _NORMS
    ATTENTION_NORMS = ("q_norm", "k_norm")  # Gemma 3's

    def __init__(self, config: ModelConfig) -> None:
        nn.Module.__init__(self)  # its own modules: the Llama parent is the interface only
        config.check_tensor_parallel(get_tp_size())
        self.config = config
        self.model = GemmaModel(config)
        self.lm_head = ParallelLMHead(config.vocab_size, config.hidden_size)
        if config.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """hidden [S, hidden_size] -> logits [S, vocab_size], soft-capped if configured."""
        logits = self.lm_head.compute_logits(hidden)
        cap = self.config.final_logit_softcapping
        return logits if cap is None else torch.tanh(logits / cap) * cap


class Gemma3ForCausalLM(Gemma2ForCausalLM):
    """Gemma 3's text decoder: what differs from Gemma 2 is configuration (q/k norms and two
    ropes follow from config.local_rope; soft caps from config.json, usually none)."""


MODEL_REGISTRY: dict[str, type[LlamaForCausalLM]] = {
    "Gemma2ForCausalLM": Gemma2ForCausalLM,
    "Gemma3ForCausalLM": Gemma3ForCausalLM,
}
