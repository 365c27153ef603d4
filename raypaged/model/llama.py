"""The Llama-family decoder: Llama 2/3, Mistral and Qwen2 share one implementation.

What differs between them is configuration only (read by ModelConfig): Qwen2 has q/k/v biases,
Llama may have attention/MLP biases, llama3 rope scaling, tied embeddings; Mistral's sliding
window (v0.1) goes to every layer's attention, which reads only the window.

Qwen3 (q/k norms, qwen3.py: swaps the attention class) and Phi-3 (fused checkpoint tensors,
phi3.py: its own checkpoint name map) are subclasses; registry.py lists every architecture.

Checkpoint names are Hugging Face's; `checkpoint_tensors()` maps each one to the layer (and the
shard of a merged weight) that loads it.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import cast

import torch
from torch import nn

from .attention import AttentionMetadata, PagedAttention
from .config import SUPPORTED_ARCHITECTURES, ModelConfig
from .layers import (
    LoadsWeights,
    MergedColumnParallelLinear,
    ParallelLMHead,
    QKVParallelLinear,
    RMSNorm,
    RowParallelLinear,
    VocabParallelEmbedding,
)
from .parallel import get_tp_size
from .rotary import RotaryEmbedding, StepRotary

KVCache = tuple[torch.Tensor, torch.Tensor]


class LlamaAttention(nn.Module):
    def __init__(self, config: ModelConfig, layer: int = 0) -> None:
        super().__init__()
        self.qkv_proj = QKVParallelLinear(
            config.hidden_size,
            config.head_dim,
            config.num_attention_heads,
            config.num_key_value_heads,
            bias=config.qkv_bias,
        )
        self.o_proj = RowParallelLinear(
            config.num_attention_heads * config.head_dim, config.hidden_size, bias=config.o_proj_bias
        )
        self.attn = PagedAttention(
            self.qkv_proj.num_heads,
            self.qkv_proj.num_kv_heads,
            config.head_dim,
            scale=config.head_dim**-0.5,
            sliding_window=config.window_of(layer),
        )

    def qkv(
        self, rope: StepRotary, hidden: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """hidden [T, H] -> q [T, Hq, D], k, v [T, Hkv, D], q and k rotated."""
        if rope.on_kernels and rope.covers(self.qkv_proj.head_dim):  # the GEMM may rotate as it stores
            qkv = self.qkv_proj.rotated(hidden, rope.cos, rope.sin)
            if qkv is not None:
                return self.qkv_proj.split(qkv)
        q, k, v = self.qkv_proj.split(self.qkv_proj(hidden))
        q, k = rope.apply(q, k)
        return q, k, v


class LlamaMLP(nn.Module):
    """SwiGLU: down(silu(gate(x)) * up(x)), gate and up in one GEMM."""

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        size = config.intermediate_size
        self.gate_up_proj = MergedColumnParallelLinear(
            config.hidden_size, [size, size], bias=config.mlp_bias
        )
        self.down_proj = RowParallelLinear(size, config.hidden_size, bias=config.mlp_bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.gate_up_proj.silu_and_mul(x))


class LlamaDecoderLayer(nn.Module):
    def __init__(
        self, config: ModelConfig, attention_class: type[LlamaAttention] = LlamaAttention,
        layer: int = 0,
    ) -> None:
        super().__init__()
        self.self_attn = attention_class(config, layer)
        self.mlp = LlamaMLP(config)
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)

    # The layer is cut at its attention call into the two halves around it, so that a piecewise
    # CUDA graph can capture everything but attention (worker/piecewise_graph.py) with the same
    # code the eager forward runs. The residual stream is carried separately so each norm can
    # add-then-normalise in one go.

    def pre_attention(
        self, rope: StepRotary, hidden: torch.Tensor, residual: torch.Tensor | None
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """(the previous layer's output, residual) -> q, k, v and the residual stream."""
        if residual is None:
            residual, hidden = hidden, self.input_layernorm(hidden)
        else:
            hidden, residual = self.input_layernorm.add_and_norm(hidden, residual)
        q, k, v = self.self_attn.qkv(rope, hidden)
        return q, k, v, residual

    def post_attention(
        self, attn_out: torch.Tensor, residual: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """attention output [T, Hq·D] -> (this layer's output, residual stream)."""
        hidden = self.self_attn.o_proj(attn_out)
        hidden, residual = self.post_attention_layernorm.add_and_norm(hidden, residual)
        return self.mlp(hidden), residual


class LlamaModel(nn.Module):
    def __init__(
        self,
        config: ModelConfig,
        make_layer: Callable[[ModelConfig, int], LlamaDecoderLayer] | None = None,
    ) -> None:
        super().__init__()
        self.embed_tokens = VocabParallelEmbedding(config.vocab_size, config.hidden_size)
        make = make_layer or (lambda config, layer: LlamaDecoderLayer(config, layer=layer))
        self.layers = nn.ModuleList(make(config, i) for i in range(config.num_hidden_layers))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.rotary_emb = RotaryEmbedding(config.head_dim, config.rope)

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        kv_caches: list[KVCache],
        meta: AttentionMetadata,
    ) -> torch.Tensor:
        hidden = self.embed_tokens(input_ids)
        rope = self.rotary_emb(positions, hidden.dtype)
        residual = None
        for i, kv_cache in enumerate(kv_caches):
            q, k, v, residual = self.pre_attention(i, rope, hidden, residual)
            attn_out = self.attention(i, q, k, v, kv_cache, meta)
            hidden, residual = self.post_attention(i, attn_out, residual)
        assert residual is not None  # the config has at least one layer
        return self.final_norm(hidden, residual)

    # The building blocks of `forward`, which the piecewise CUDA-graph runner also calls. The
    # casts: nn.ModuleList's items are typed as Module.

    def pre_attention(
        self, i: int, rope: StepRotary, hidden: torch.Tensor, residual: torch.Tensor | None
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """Layer i up to its attention: (add &) input norm, QKV projection, rope."""
        return cast(LlamaDecoderLayer, self.layers[i]).pre_attention(rope, hidden, residual)

    def attention(
        self,
        i: int,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        kv_cache: KVCache,
        meta: AttentionMetadata,
        out: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Layer i's paged attention (writes the step's K/V) -> [T, Hq·D], into `out` if given."""
        attn = cast(LlamaDecoderLayer, self.layers[i]).self_attn.attn
        attn_out = attn(q, k, v, kv_cache, meta.for_layer(i), out=out)
        return attn_out.reshape(attn_out.shape[0], -1)

    def post_attention(
        self, i: int, attn_out: torch.Tensor, residual: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Layer i after its attention: o_proj, add & post-attention norm, MLP."""
        return cast(LlamaDecoderLayer, self.layers[i]).post_attention(attn_out, residual)

    def final_norm(self, hidden: torch.Tensor, residual: torch.Tensor) -> torch.Tensor:
        return self.norm.add_and_norm(hidden, residual)[0]


@dataclass(frozen=True)
class CheckpointTarget:
    """Where one checkpoint tensor goes: `module.load_weight(param, shard, source)`."""

    module: LoadsWeights
    param: str
    shard: object = None


# Checkpoint projection name -> (our merged module, shard id).
_MERGED = {
    "q_proj": ("qkv_proj", "q"),
    "k_proj": ("qkv_proj", "k"),
    "v_proj": ("qkv_proj", "v"),
    "gate_proj": ("gate_up_proj", 0),
    "up_proj": ("gate_up_proj", 1),
}


class LlamaForCausalLM(nn.Module):
    # What a family built on this decoder changes in its layers (qwen3.py).
    attention_class: type[LlamaAttention] = LlamaAttention
    # Each layer's norms, and its attention's (those it has), by checkpoint name.
    LAYER_NORMS: tuple[str, ...] = ("input_layernorm", "post_attention_layernorm")
    ATTENTION_NORMS: tuple[str, ...] = ()

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        config.check_tensor_parallel(get_tp_size())
        self.config = config
        self.model = LlamaModel(config, self._make_layer)
        self.lm_head = ParallelLMHead(config.vocab_size, config.hidden_size)
        if config.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight

    def _make_layer(self, config: ModelConfig, layer: int) -> LlamaDecoderLayer:
        return LlamaDecoderLayer(config, self.attention_class, layer)

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        kv_caches: list[KVCache],
        attn_metadata: AttentionMetadata,
    ) -> torch.Tensor:
        """input_ids, positions [T] -> final hidden states [T, hidden_size]."""
        if len(kv_caches) != self.config.num_hidden_layers:
            raise ValueError(
                f"{len(kv_caches)} KV caches for {self.config.num_hidden_layers} layers"
            )
        return self.model(input_ids, positions, kv_caches, attn_metadata)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """hidden [S, hidden_size] -> logits [S, vocab_size] over the full vocabulary."""
        return self.lm_head.compute_logits(hidden)

    def checkpoint_tensors(self) -> dict[str, CheckpointTarget]:
        """Every tensor the checkpoint must hold, by its Hugging Face name."""
        targets: dict[str, CheckpointTarget] = {
            "model.embed_tokens.weight": CheckpointTarget(self.model.embed_tokens, "weight"),
            "model.norm.weight": CheckpointTarget(self.model.norm, "weight"),
        }
        if not self.config.tie_word_embeddings:
            targets["lm_head.weight"] = CheckpointTarget(self.lm_head, "weight")
        for i, layer in enumerate(self.model.layers):
            prefix = f"model.layers.{i}"
            for norm in self.LAYER_NORMS:
                targets[f"{prefix}.{norm}.weight"] = CheckpointTarget(getattr(layer, norm), "weight")
            for norm in self.ATTENTION_NORMS:
                if getattr(layer.self_attn, norm, None) is not None:
                    targets[f"{prefix}.self_attn.{norm}.weight"] = CheckpointTarget(
                        getattr(layer.self_attn, norm), "weight")
            blocks = {"self_attn": layer.self_attn, "mlp": layer.mlp}
            projections = {
                "self_attn": ("q_proj", "k_proj", "v_proj", "o_proj"),
                "mlp": ("gate_proj", "up_proj", "down_proj"),
            }
            for block_name, names in projections.items():
                for name in names:
                    module_name, shard = _MERGED.get(name, (name, None))
                    module = getattr(blocks[block_name], module_name)
                    for param in ("weight", "bias"):
                        if getattr(module, param, None) is not None:
                            targets[f"{prefix}.{block_name}.{name}.{param}"] = CheckpointTarget(
                                module, param, shard
                            )
        return targets


class MistralForCausalLM(LlamaForCausalLM):
    pass


class Qwen2ForCausalLM(LlamaForCausalLM):
    pass


MODEL_REGISTRY: dict[str, type[LlamaForCausalLM]] = {
    "LlamaForCausalLM": LlamaForCausalLM,
    "MistralForCausalLM": MistralForCausalLM,
    "Qwen2ForCausalLM": Qwen2ForCausalLM,
}
assert set(MODEL_REGISTRY) <= set(SUPPORTED_ARCHITECTURES)  # registry.py holds them all
