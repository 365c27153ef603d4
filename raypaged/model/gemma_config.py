"""What Gemma 2 and Gemma 3 (text) add to ModelConfig, read from their config.json.

Both layouts transformers writes are understood: 5's (`layer_types`, Gemma 3's per-layer-type
`rope_parameters`) and 4's (Gemma 2: sliding on even layers; Gemma 3: `sliding_window_pattern`,
`rope_local_base_freq` for the local layers and `rope_theta` / `rope_scaling` for the global ones).
"""

from __future__ import annotations

from typing import Any

from .config import ModelConfigError, RopeConfig, _rope_config

GEMMA_ARCHITECTURES = ("Gemma2ForCausalLM", "Gemma3ForCausalLM")
# transformers' names of the tanh-approximated GELU of GeGLU.
GELU_TANH = ("gelu_pytorch_tanh", "gelu_tanh")


def gemma_fields(raw: dict[str, Any]) -> dict[str, Any]:
    """ModelConfig fields of a Gemma config: activation, soft caps, attention scale, layer
    windows where config.json has no layer_types, and (Gemma 3) the two ropes."""
    architecture = next(a for a in raw["architectures"] if a in GEMMA_ARCHITECTURES)
    act = raw.get("hidden_activation") or raw.get("hidden_act") or "gelu_pytorch_tanh"
    if act not in GELU_TANH:
        raise ModelConfigError(f"hidden_activation {act!r} is not supported (Gemma: {GELU_TANH})")
    if raw.get("use_bidirectional_attention"):
        raise ModelConfigError("use_bidirectional_attention is not supported (causal decoding only)")
    fields: dict[str, Any] = {
        "hidden_act": "gelu_pytorch_tanh",
        "attn_logit_softcapping": _optional_float(raw, "attn_logit_softcapping"),
        "final_logit_softcapping": _optional_float(raw, "final_logit_softcapping"),
        "query_pre_attn_scalar": float(raw.get("query_pre_attn_scalar") or 256),
    }
    layers = int(raw.get("num_hidden_layers") or 0)
    window = raw.get("sliding_window")
    if not raw.get("layer_types") and window:
        if architecture == "Gemma2ForCausalLM":
            sliding = [i % 2 == 0 for i in range(layers)]
        else:
            pattern = int(raw.get("sliding_window_pattern") or 6)
            sliding = [(i + 1) % pattern != 0 for i in range(layers)]
        fields["layer_windows"] = tuple(int(window) if s else None for s in sliding)
    if architecture == "Gemma3ForCausalLM":
        fields.update(_gemma3_ropes(raw))
    return fields


def _gemma3_ropes(raw: dict[str, Any]) -> dict[str, RopeConfig]:
    """The global layers' rope (`rope`) and the local layers' (`local_rope`)."""
    architecture = "Gemma3ForCausalLM"
    max_pos, head_dim = int(raw["max_position_embeddings"]), int(raw.get("head_dim") or 256)
    params = raw.get("rope_parameters")
    if isinstance(params, dict) and params and all(isinstance(v, dict) for v in params.values()):
        unknown = set(params) - {"sliding_attention", "full_attention"}
        if unknown:
            raise ModelConfigError(f"rope_parameters for layer types {sorted(unknown)} are not supported")
        ropes = {kind: _rope_config({"rope_parameters": p}, max_pos, head_dim, architecture)
                 for kind, p in params.items()}
        local = ropes.get("sliding_attention")
        return {"rope": ropes.get("full_attention") or local or RopeConfig(),
                "local_rope": local or ropes["full_attention"]}
    local_theta = float(raw.get("rope_local_base_freq") or 10000.0)
    return {"rope": _rope_config(raw, max_pos, head_dim, architecture),
            "local_rope": RopeConfig(theta=local_theta)}


def _optional_float(raw: dict[str, Any], key: str) -> float | None:
    value = raw.get(key)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, (int, float)) or value <= 0:
        raise ModelConfigError(f"config.json field {key!r} must be a positive number, got {value!r}")
    return float(value)
