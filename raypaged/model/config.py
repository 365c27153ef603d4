"""ModelConfig: what the decoder, the loader and the worker need from a Hugging Face config.json.

Parsed by hand (not through `transformers.AutoConfig`) so that every field we rely on is checked
here once, with an error naming the field, and so that both config layouts are understood:
transformers 4 (`rope_theta` + `rope_scaling`) and 5 (`rope_parameters`).
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from raypaged.config.base import ConfigError

from .rope_scaling import SCALED_ROPE_TYPES, ScaledRope, parse_scaled_rope

# Architectures the decoder in llama.py serves; the names as config.json's "architectures" lists them.
SUPPORTED_ARCHITECTURES = (
    "LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM", "Qwen3ForCausalLM",
    "Phi3ForCausalLM", "Gemma2ForCausalLM", "Gemma3ForCausalLM",
)  # fmt: skip
SUPPORTED_ROPE_TYPES = ("default", "linear", "llama3", *SCALED_ROPE_TYPES)
# Architectures whose transformers implementation rotates only part of each head.
_PARTIAL_ROTARY_ARCHITECTURES = ("Phi3ForCausalLM",)
CHECKPOINT_DTYPES = ("float32", "float16", "bfloat16")


class ModelConfigError(ConfigError):
    """config.json describes a model this decoder cannot serve, or is malformed."""


@dataclass(frozen=True)
class RopeConfig:
    theta: float = 10000.0
    rope_type: str = "default"  # one of SUPPORTED_ROPE_TYPES
    factor: float = 1.0  # linear: positions are divided by it; llama3: low-frequency divisor
    low_freq_factor: float = 1.0  # llama3 only
    high_freq_factor: float = 4.0  # llama3 only
    original_max_position_embeddings: int = 8192  # llama3 only
    partial_rotary_factor: float = 1.0  # the first int(head_dim * it) dims of a head are rotated
    scaled: ScaledRope | None = None  # yarn, dynamic, longrope (rope_scaling.py)


@dataclass(frozen=True)
class ModelConfig:
    architecture: str
    model_type: str
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    vocab_size: int
    rms_norm_eps: float
    rope: RopeConfig
    max_position_embeddings: int
    # Longest sequence (prompt + output) served.
    max_model_len: int
    tie_word_embeddings: bool = False
    qkv_bias: bool = False
    o_proj_bias: bool = False
    mlp_bias: bool = False
    sliding_window: int | None = None
    # Per layer: its sliding window or None (full attention). Empty: every layer has
    # `sliding_window` (Mistral). Gemma's alternate, from config.json's layer_types.
    layer_windows: tuple[int | None, ...] = ()
    hidden_act: str = "silu"
    attn_logit_softcapping: float | None = None  # scores = c · tanh(scores / c) (Gemma 2)
    final_logit_softcapping: float | None = None  # logits = c · tanh(logits / c) (Gemma 2)
    query_pre_attn_scalar: float | None = None  # attention scale = this ** -0.5 (Gemma)
    local_rope: RopeConfig | None = None  # the sliding layers' rope where it differs (Gemma 3)
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = ()
    dtype: str = "float32"  # the checkpoint's dtype, used for load dtype "auto"
    # config.json's quantization_config as it stands (model/quantization/schemes.py reads it).
    quantization_config: dict[str, Any] | None = field(default=None, compare=False)
    model_dir: str | None = field(default=None, compare=False)

    @classmethod
    def from_pretrained(cls, model_dir: str | Path, max_model_len: int | None = None) -> ModelConfig:
        path = Path(model_dir) / "config.json"
        if not path.is_file():
            raise ModelConfigError(f"no config.json in {model_dir}")
        try:
            raw = json.loads(path.read_text())
        except json.JSONDecodeError as e:
            raise ModelConfigError(f"{path} is not valid JSON: {e}") from e
        return cls.from_dict(raw, max_model_len=max_model_len, model_dir=str(model_dir))

    @classmethod
    def from_dict(
        cls, raw: dict[str, Any], max_model_len: int | None = None, model_dir: str | None = None
    ) -> ModelConfig:
        archs = raw.get("architectures") or []
        supported = [a for a in archs if a in SUPPORTED_ARCHITECTURES]
        if not supported:
            raise ModelConfigError(
                f"unknown architecture {archs or '(none given)'}: raypaged serves "
                f"{', '.join(SUPPORTED_ARCHITECTURES)}"
            )
        architecture = supported[0]
        from .gemma_config import GEMMA_ARCHITECTURES, gemma_fields

        extra = gemma_fields(raw) if architecture in GEMMA_ARCHITECTURES else {}
        act = raw.get("hidden_act", "silu")
        if act != "silu" and not extra:
            raise ModelConfigError(f"hidden_act {act!r} is not supported (only 'silu', SwiGLU)")

        hidden = _positive_int(raw, "hidden_size")
        heads = _positive_int(raw, "num_attention_heads")
        kv_heads = int(raw.get("num_key_value_heads") or heads)
        head_dim = int(raw.get("head_dim") or hidden // heads)
        if heads % kv_heads:
            raise ModelConfigError(
                f"num_attention_heads {heads} is not a multiple of num_key_value_heads {kv_heads}"
            )
        max_pos = _positive_int(raw, "max_position_embeddings")
        is_qwen2 = architecture == "Qwen2ForCausalLM"
        attention_bias = bool(raw.get("attention_bias", False))
        rope = extra.pop("rope", None) or _rope_config(raw, max_pos, head_dim, architecture)
        served_pos = rope.scaled.max_model_len(max_pos) if rope.scaled else max_pos

        # Qwen3 too stores a window that use_sliding_window switches on.
        sliding_window = _sliding_window(raw, architecture in ("Qwen2ForCausalLM", "Qwen3ForCausalLM"))
        if max_model_len is None:
            max_model_len = served_pos
        elif max_model_len < 1:
            raise ModelConfigError(f"max_model_len must be positive, got {max_model_len}")
        elif max_model_len > served_pos:
            raise ModelConfigError(
                f"max_model_len {max_model_len} exceeds "
                + (f"max_position_embeddings {max_pos}" if served_pos == max_pos else
                   f"the {served_pos} positions {rope.rope_type} rope serves "
                   "(original_max_position_embeddings x factor)")
                + (" (dynamic NTK rope is served only up to max_position_embeddings, where its "
                   "frequencies do not depend on how a sequence is split into steps)"
                   if rope.rope_type == "dynamic" else "")
            )
        if rope.scaled is not None:
            rope = replace(rope, scaled=rope.scaled.served_at(max_model_len))

        eos = raw.get("eos_token_id")
        eos_ids = tuple(eos) if isinstance(eos, list) else (() if eos is None else (int(eos),))
        dtype = str(raw.get("dtype") or raw.get("torch_dtype") or "float32")
        return cls(
            architecture=architecture,
            model_type=str(raw.get("model_type", "")),
            hidden_size=hidden,
            intermediate_size=_positive_int(raw, "intermediate_size"),
            num_hidden_layers=_positive_int(raw, "num_hidden_layers"),
            num_attention_heads=heads,
            num_key_value_heads=kv_heads,
            head_dim=head_dim,
            vocab_size=_positive_int(raw, "vocab_size"),
            rms_norm_eps=float(raw.get("rms_norm_eps", 1e-6)),
            rope=rope,
            max_position_embeddings=max_pos,
            max_model_len=max_model_len,
            tie_word_embeddings=bool(raw.get("tie_word_embeddings", False)),
            # Qwen2 always has q/k/v biases and no o_proj bias; Llama's attention_bias covers all four.
            qkv_bias=is_qwen2 or attention_bias,
            o_proj_bias=attention_bias and not is_qwen2,
            mlp_bias=bool(raw.get("mlp_bias", False)) and not is_qwen2,
            sliding_window=sliding_window,
            layer_windows=extra.pop("layer_windows", None) or _layer_windows(raw, sliding_window),
            bos_token_id=raw.get("bos_token_id"),
            eos_token_ids=eos_ids,
            dtype=dtype if dtype in CHECKPOINT_DTYPES else "float32",
            quantization_config=_quantization_config(raw),
            model_dir=model_dir,
            **extra,
        )

    def window_of(self, layer: int) -> int | None:
        """Layer `layer`'s sliding window (keys (p - W, p] for a query at p), None: full."""
        return self.layer_windows[layer] if self.layer_windows else self.sliding_window

    def all_windows(self) -> tuple[int | None, ...]:
        """Every layer's window_of, in layer order."""
        return tuple(self.window_of(i) for i in range(self.num_hidden_layers))

    @property
    def attention_scale(self) -> float:
        scalar = self.query_pre_attn_scalar
        return (self.head_dim if scalar is None else scalar) ** -0.5

    # -- tensor-parallel shapes ---------------------------------------------------------------

    def check_tensor_parallel(self, tp: int) -> None:
        """Raise unless this model can be split over `tp` ranks."""
        if tp < 1:
            raise ModelConfigError(f"tensor_parallel_size must be >= 1, got {tp}")
        if self.num_attention_heads % tp:
            raise ModelConfigError(
                f"num_attention_heads {self.num_attention_heads} is not divisible by "
                f"tensor_parallel_size {tp}"
            )
        kv = self.num_key_value_heads
        if (kv >= tp and kv % tp) or (kv < tp and tp % kv):
            raise ModelConfigError(
                f"num_key_value_heads {kv} and tensor_parallel_size {tp}: one must divide the other"
            )
        if self.intermediate_size % tp:
            raise ModelConfigError(
                f"intermediate_size {self.intermediate_size} is not divisible by "
                f"tensor_parallel_size {tp}"
            )

    def num_heads_per_rank(self, tp: int) -> int:
        self.check_tensor_parallel(tp)
        return self.num_attention_heads // tp

    def num_kv_heads_per_rank(self, tp: int) -> int:
        """KV heads each rank holds (and allocates cache for): replicated when tp > kv heads."""
        self.check_tensor_parallel(tp)
        return max(1, self.num_key_value_heads // tp)


def _positive_int(raw: dict[str, Any], key: str) -> int:
    value = raw.get(key)
    if not isinstance(value, int) or isinstance(value, bool) or value < 1:
        raise ModelConfigError(f"config.json field {key!r} must be a positive integer, got {value!r}")
    return value


def _quantization_config(raw: dict[str, Any]) -> dict[str, Any] | None:
    value = raw.get("quantization_config")
    if value is not None and not isinstance(value, dict):
        raise ModelConfigError(f"config.json field 'quantization_config' must be an object, got {value!r}")
    return value


def _sliding_window(raw: dict[str, Any], is_qwen2: bool) -> int | None:
    # Qwen2 stores a window even when it is switched off by use_sliding_window.
    if is_qwen2 and not raw.get("use_sliding_window", False):
        return None
    window = raw.get("sliding_window")
    return int(window) if window else None


def _layer_windows(raw: dict[str, Any], sliding_window: int | None) -> tuple[int | None, ...]:
    """config.json's layer_types (transformers >= 4.53) as windows; absent: () (every layer
    `sliding_window`). A window-less config has no sliding layers whatever it lists."""
    layer_types = raw.get("layer_types")
    if sliding_window is None:
        return ()
    if not layer_types and {"Qwen2ForCausalLM", "Qwen3ForCausalLM"} & set(raw.get("architectures") or []):
        # transformers 4's Qwen2 / Qwen3: the layers from max_window_layers on slide.
        first = int(raw.get("max_window_layers", 0) or 0)
        return tuple(None if i < first else sliding_window for i in range(raw["num_hidden_layers"]))
    if not layer_types:
        return ()
    known = ("sliding_attention", "full_attention")
    if any(t not in known for t in layer_types):
        raise ModelConfigError(f"layer_types {sorted(set(layer_types) - set(known))} are not supported")
    if len(layer_types) != raw.get("num_hidden_layers"):
        raise ModelConfigError(f"layer_types lists {len(layer_types)} layers, "
                               f"num_hidden_layers is {raw.get('num_hidden_layers')}")
    return tuple(sliding_window if t == "sliding_attention" else None for t in layer_types)


def _rope_config(raw: dict[str, Any], max_pos: int, head_dim: int, architecture: str) -> RopeConfig:
    params = dict(raw.get("rope_parameters") or raw.get("rope_scaling") or {})
    if params and all(isinstance(v, dict) for v in params.values()):
        raise ModelConfigError("per-layer-type rope_parameters are not supported")
    theta = float(params.get("rope_theta", raw.get("rope_theta", 10000.0)))
    rope_type = params.get("rope_type", params.get("type", "default"))
    # "su" is longrope's old name; transformers' Phi-3 also reads "yarn" as longrope.
    if rope_type == "su" or (rope_type == "yarn" and architecture == "Phi3ForCausalLM"):
        rope_type = "longrope"
    if rope_type not in SUPPORTED_ROPE_TYPES:
        raise ModelConfigError(
            f"rope type {rope_type!r} is not supported (supported: {', '.join(SUPPORTED_ROPE_TYPES)})"
        )
    partial = float(params.get("partial_rotary_factor", raw.get("partial_rotary_factor", 1.0)))
    if partial != 1.0 and architecture not in _PARTIAL_ROTARY_ARCHITECTURES:
        raise ModelConfigError(
            f"partial_rotary_factor {partial} is not supported for {architecture} (only 1.0; "
            f"partial rotary is served for {', '.join(_PARTIAL_ROTARY_ARCHITECTURES)})"
        )
    rotary_dim = int(head_dim * partial)
    if rotary_dim % 2 or rotary_dim < 2:
        raise ModelConfigError(
            f"rotary dimension {rotary_dim} (head_dim {head_dim} x partial_rotary_factor "
            f"{partial}) must be even and positive for rotary embeddings"
        )
    base = RopeConfig(theta=theta, rope_type=rope_type, partial_rotary_factor=partial)
    try:
        if rope_type == "linear":
            return replace(base, factor=float(params["factor"]))
        if rope_type == "llama3":
            return replace(
                base,
                factor=float(params["factor"]),
                low_freq_factor=float(params["low_freq_factor"]),
                high_freq_factor=float(params["high_freq_factor"]),
                # transformers prefers a top-level original_max_position_embeddings (Phi-3 style).
                original_max_position_embeddings=int(
                    raw.get("original_max_position_embeddings")
                    or params.get("original_max_position_embeddings", max_pos)
                ),
            )
        if rope_type in SCALED_ROPE_TYPES:
            return replace(
                base, scaled=parse_scaled_rope(rope_type, params, raw, max_pos, rotary_dim)
            )
    except KeyError as e:
        raise ModelConfigError(f"{rope_type} rope scaling is missing {e.args[0]!r}") from e
    except (TypeError, ValueError) as e:
        raise ModelConfigError(f"{rope_type} rope scaling: {e}") from e
    return base
