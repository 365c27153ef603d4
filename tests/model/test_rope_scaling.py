"""Rope scalings: inverse frequencies and attention factors bit-identical to transformers'
ROPE_INIT_FUNCTIONS, for configs built with transformers' own config classes; what each scaling
serves (max_model_len) and refuses."""

from __future__ import annotations

import pytest
import torch

from raypaged.model.config import ModelConfig, ModelConfigError
from raypaged.model.rope_scaling import LongRope
from raypaged.model.rotary import RotaryEmbedding, rope_inverse_frequencies

SHAPE = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2, vocab_size=100, max_position_embeddings=512)


def _hf_config(kind: str, **kwargs):
    import transformers as tf

    return {"llama": tf.LlamaConfig, "qwen2": tf.Qwen2Config, "qwen3": tf.Qwen3Config,
            "phi3": tf.Phi3Config}[kind](**{**SHAPE, **kwargs})


def _ours(hf_config, max_model_len: int | None = None) -> ModelConfig:
    raw = hf_config.to_dict()
    raw["architectures"] = [type(hf_config).__name__.replace("Config", "ForCausalLM")]
    return ModelConfig.from_dict(raw, max_model_len=max_model_len)


def _hf_inv_freq(hf_config, seq_len: int | None = None) -> tuple[torch.Tensor, float]:
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    rope_type = hf_config.rope_parameters["rope_type"]
    return ROPE_INIT_FUNCTIONS[rope_type](hf_config, "cpu", seq_len=seq_len)


def _assert_same(ours: ModelConfig, hf_config, seq_len: int | None = None) -> None:
    expected, factor = _hf_inv_freq(hf_config, seq_len)
    got = rope_inverse_frequencies(ours.head_dim, ours.rope)
    assert got.dtype == torch.float32
    assert torch.equal(got, expected), (got, expected)
    assert RotaryEmbedding(ours.head_dim, ours.rope).attention_factor == factor


@pytest.mark.parametrize("params", [
    dict(factor=4.0, original_max_position_embeddings=128),  # attention factor from factor
    dict(factor=8.0, original_max_position_embeddings=64, beta_fast=16, beta_slow=2),
    dict(factor=4.0, original_max_position_embeddings=128, mscale=0.707, mscale_all_dim=1.0),
    dict(factor=4.0, original_max_position_embeddings=128, attention_factor=1.25, truncate=False),
    dict(factor=2.0),  # original defaults to max_position_embeddings
])  # fmt: skip
@pytest.mark.parametrize("kind", ["qwen2", "qwen3", "llama"])
def test_yarn_matches_transformers(kind, params):
    hf = _hf_config(kind, rope_parameters=dict(rope_type="yarn", rope_theta=1e6, **params))
    _assert_same(_ours(hf), hf)


def test_yarn_serves_the_stretched_original_context():
    hf = _hf_config("qwen2", max_position_embeddings=128,
                    rope_parameters=dict(rope_type="yarn", factor=4.0,
                                         original_max_position_embeddings=128))
    assert _ours(hf).max_model_len == 512
    with pytest.raises(ModelConfigError, match=r"exceeds the 512 positions yarn rope serves \("):
        _ours(hf, max_model_len=513)


def test_transformers4_yarn_layout():
    raw = {**SHAPE, "architectures": ["Qwen2ForCausalLM"], "rope_theta": 1e6,
           "rope_scaling": {"type": "yarn", "factor": 4.0, "original_max_position_embeddings": 128}}
    hf = _hf_config("qwen2", rope_parameters=dict(rope_type="yarn", rope_theta=1e6, factor=4.0,
                                                  original_max_position_embeddings=128))
    _assert_same(ModelConfig.from_dict(raw), hf)


def test_dynamic_is_served_up_to_max_position_embeddings_where_transformers_does_not_scale():
    hf = _hf_config("llama", rope_parameters=dict(rope_type="dynamic", factor=1.1, rope_theta=1e4))
    ours = _ours(hf)
    _assert_same(ours, hf)
    _assert_same(ours, hf, seq_len=ours.max_position_embeddings)
    with pytest.raises(ModelConfigError, match="dynamic NTK rope is served only up to"):
        _ours(hf, max_model_len=513)


@pytest.mark.parametrize("partial", [1.0, 0.75])
def test_longrope_short_and_long_factors_match_transformers(partial):
    rotary_half = int(16 * partial) // 2
    hf = _hf_config(
        "phi3", original_max_position_embeddings=64, partial_rotary_factor=partial,
        rope_parameters=dict(rope_type="longrope", rope_theta=1e4, partial_rotary_factor=partial,
                             short_factor=[1.0 + 0.05 * i for i in range(rotary_half)],
                             long_factor=[2.0 + 0.5 * i for i in range(rotary_half)]),
    )  # fmt: skip
    short = _ours(hf, max_model_len=64)  # never past the original context: the short factors
    assert isinstance(short.rope.scaled, LongRope) and not short.rope.scaled.use_long
    _assert_same(short, hf)
    long = _ours(hf)  # 512 > 64: the long factors for every token
    assert isinstance(long.rope.scaled, LongRope) and long.rope.scaled.use_long
    _assert_same(long, hf, seq_len=65)


def test_phi3_su_and_yarn_names_are_longrope():
    for name in ("su", "yarn"):
        raw = {**SHAPE, "architectures": ["Phi3ForCausalLM"], "original_max_position_embeddings": 64,
               "rope_scaling": {"type": name, "short_factor": [1.0] * 8, "long_factor": [2.0] * 8}}
        assert isinstance(ModelConfig.from_dict(raw).rope.scaled, LongRope)


@pytest.mark.parametrize("changes, message", [
    (dict(rope_scaling={"rope_type": "longrope", "short_factor": [1.0] * 3, "long_factor": [1.0] * 8}),
     "short_factor has 3 entries, expected rotary dim / 2 = 8"),
    (dict(rope_scaling={"rope_type": "longrope", "short_factor": [1.0] * 8}),
     "longrope rope scaling is missing 'long_factor'"),
    (dict(rope_scaling={"rope_type": "dynamic"}), "dynamic rope scaling is missing 'factor'"),
    (dict(rope_scaling={"rope_type": "mrope", "factor": 2.0}), "rope type 'mrope' is not supported"),
    (dict(partial_rotary_factor=0.5, architectures=["LlamaForCausalLM"]),
     "partial_rotary_factor 0.5 is not supported for LlamaForCausalLM"),
    (dict(partial_rotary_factor=0.1), "rotary dimension 1"),
])  # fmt: skip
def test_unservable_rope_configs_are_refused_naming_the_field(changes, message):
    raw = {**SHAPE, "architectures": ["Phi3ForCausalLM"], **changes}
    with pytest.raises(ModelConfigError, match=message):
        ModelConfig.from_dict(raw)
