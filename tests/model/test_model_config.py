"""ModelConfig parsing (both transformers config layouts), TP shape rules, RoPE frequencies and
the attention metadata's checks."""

from __future__ import annotations

import pytest
import torch

from raypaged.model.attention import AttentionMetadata
from raypaged.model.config import ModelConfig, ModelConfigError, RopeConfig
from raypaged.model.rotary import rope_inverse_frequencies

BASE = dict(
    architectures=["LlamaForCausalLM"],
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=8,
    num_key_value_heads=2,
    vocab_size=100,
    max_position_embeddings=512,
)


def config(**changes) -> ModelConfig:
    return ModelConfig.from_dict({**BASE, **changes})


def test_transformers4_layout_rope_theta_and_rope_scaling():
    c = config(rope_theta=500000.0, rope_scaling={"type": "linear", "factor": 4.0})
    assert c.rope == RopeConfig(theta=500000.0, rope_type="linear", factor=4.0)
    c = config(
        rope_theta=500000.0,
        rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                      "high_freq_factor": 4.0, "original_max_position_embeddings": 8192},
    )  # fmt: skip
    assert (c.rope.rope_type, c.rope.theta, c.rope.original_max_position_embeddings) == (
        "llama3", 500000.0, 8192,
    )  # fmt: skip


def test_transformers5_layout_rope_parameters():
    c = config(rope_parameters={"rope_type": "default", "rope_theta": 1e6})
    assert c.rope == RopeConfig(theta=1e6)
    assert config().rope == RopeConfig(theta=10000.0)


@pytest.mark.parametrize(
    "changes, message",
    [
        (dict(rope_scaling={"rope_type": "proportional", "factor": 4.0}), "rope type .proportional. is not supported"),
        (dict(rope_scaling={"rope_type": "llama3", "factor": 8.0}), "llama3 rope scaling is missing 'low_freq_factor'"),
        (dict(partial_rotary_factor=0.5), "partial_rotary_factor 0.5"),
        (dict(hidden_act="gelu"), "hidden_act 'gelu'"),
        (dict(architectures=["BertModel"]), r"unknown architecture \['BertModel'\]"),
        (dict(num_key_value_heads=3), "not a multiple of num_key_value_heads 3"),
        (dict(hidden_size=None), "'hidden_size' must be a positive integer"),
    ],
)  # fmt: skip
def test_unservable_configs_are_refused_with_the_field_named(changes, message):
    with pytest.raises(ModelConfigError, match=message):
        config(**changes)


def test_head_dim_defaults_and_overrides():
    assert config().head_dim == 8
    assert config(head_dim=32).head_dim == 32


def test_qwen2_biases_and_switched_off_sliding_window():
    c = config(architectures=["Qwen2ForCausalLM"], sliding_window=64, use_sliding_window=False)
    assert (c.qkv_bias, c.o_proj_bias, c.sliding_window, c.max_model_len) == (True, False, None, 512)


def test_llama_attention_bias_covers_o_proj():
    c = config(attention_bias=True, mlp_bias=True)
    assert (c.qkv_bias, c.o_proj_bias, c.mlp_bias) == (True, True, True)


def test_sliding_window_serves_past_the_window_on_every_layer():
    c = config(architectures=["MistralForCausalLM"], sliding_window=128)
    assert c.max_model_len == 512  # the window no longer caps it: the kernels read the window
    assert [c.window_of(i) for i in range(c.num_hidden_layers)] == [128] * c.num_hidden_layers
    assert ModelConfig.from_dict({**BASE, "sliding_window": 128}, max_model_len=200).max_model_len == 200
    with pytest.raises(ModelConfigError, match="exceeds max_position_embeddings 512"):
        ModelConfig.from_dict(BASE, max_model_len=1024)


def test_layer_types_give_per_layer_windows():
    raw = {**BASE, "sliding_window": 16, "layer_types": ["sliding_attention", "full_attention"]}
    raw["num_hidden_layers"] = 2
    assert ModelConfig.from_dict(raw).layer_windows == (16, None)
    with pytest.raises(ModelConfigError, match="layer_types"):
        ModelConfig.from_dict({**raw, "layer_types": ["chunked_attention", "full_attention"]})


def test_qwen2_sliding_window_from_max_window_layers():
    raw = {**BASE, "architectures": ["Qwen2ForCausalLM"], "num_hidden_layers": 4,
           "use_sliding_window": True, "sliding_window": 32, "max_window_layers": 3}
    assert ModelConfig.from_dict(raw).layer_windows == (None, None, None, 32)


def test_gemma_fields_in_both_config_layouts():
    gemma2 = {**BASE, "architectures": ["Gemma2ForCausalLM"], "num_hidden_layers": 4,
              "sliding_window": 8, "hidden_activation": "gelu_pytorch_tanh",
              "query_pre_attn_scalar": 64, "attn_logit_softcapping": 50.0,
              "final_logit_softcapping": 30.0}
    c = ModelConfig.from_dict(gemma2)  # transformers 4: no layer_types, even layers slide
    assert c.layer_windows == (8, None, 8, None)
    assert (c.attention_scale, c.attn_logit_softcapping, c.final_logit_softcapping) == (1 / 8, 50.0, 30.0)
    gemma3 = {**gemma2, "architectures": ["Gemma3ForCausalLM"], "num_hidden_layers": 7,
              "sliding_window_pattern": 6, "rope_local_base_freq": 10000.0, "rope_theta": 1e6,
              "rope_scaling": {"rope_type": "linear", "factor": 8.0},
              "final_logit_softcapping": None, "attn_logit_softcapping": None}
    c = ModelConfig.from_dict(gemma3)
    assert c.layer_windows == (8, 8, 8, 8, 8, None, 8)
    assert (c.rope.theta, c.rope.rope_type, c.rope.factor) == (1e6, "linear", 8.0)
    assert c.local_rope is not None and (c.local_rope.theta, c.local_rope.rope_type) == (1e4, "default")
    with pytest.raises(ModelConfigError, match="hidden_activation"):
        ModelConfig.from_dict({**gemma2, "hidden_activation": "relu"})
    with pytest.raises(ModelConfigError, match="bidirectional"):
        ModelConfig.from_dict({**gemma3, "use_bidirectional_attention": True})


def test_eos_ids_list_and_dtype():
    c = config(eos_token_id=[128001, 128009], torch_dtype="bfloat16")
    assert c.eos_token_ids == (128001, 128009)
    assert c.dtype == "bfloat16"


def test_kv_heads_per_rank_split_and_replicated():
    c = config()  # 8 query heads, 2 KV heads
    assert [c.num_kv_heads_per_rank(tp) for tp in (1, 2, 4, 8)] == [2, 1, 1, 1]
    assert [c.num_heads_per_rank(tp) for tp in (1, 2, 4, 8)] == [8, 4, 2, 1]
    with pytest.raises(ModelConfigError, match="not divisible by tensor_parallel_size 3"):
        c.num_kv_heads_per_rank(3)
    c = config(hidden_size=96, intermediate_size=192, num_attention_heads=12, num_key_value_heads=3)
    for tp in (2, 4):  # neither divides the other
        with pytest.raises(ModelConfigError, match=f"num_key_value_heads 3 and tensor_parallel_size {tp}"):
            c.check_tensor_parallel(tp)
    assert c.num_kv_heads_per_rank(6) == 1  # 6 ranks, each KV head replicated on two


def test_from_pretrained_without_config_json(tmp_path):
    with pytest.raises(ModelConfigError, match="no config.json"):
        ModelConfig.from_pretrained(tmp_path)


@pytest.mark.parametrize(
    "rope_parameters",
    [
        {"rope_type": "default", "rope_theta": 10000.0},
        {"rope_type": "linear", "rope_theta": 10000.0, "factor": 2.0},
        {"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0, "low_freq_factor": 1.0,
         "high_freq_factor": 4.0, "original_max_position_embeddings": 64},
    ],
)  # fmt: skip
def test_rope_frequencies_equal_transformers(rope_parameters):
    from transformers import LlamaConfig
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS
    from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding

    hf_config = LlamaConfig(hidden_size=256, num_attention_heads=2, rope_parameters=rope_parameters)
    init = ROPE_INIT_FUNCTIONS.get(
        rope_parameters["rope_type"], LlamaRotaryEmbedding.compute_default_rope_parameters
    )
    expected, scaling = init(hf_config)
    ours = config(hidden_size=256, num_attention_heads=2, num_key_value_heads=2,
                  rope_parameters=rope_parameters)  # fmt: skip
    assert scaling == 1.0
    torch.testing.assert_close(rope_inverse_frequencies(128, ours.rope), expected, rtol=0, atol=0)


def _metadata(**changes):
    fields = dict(
        slot_mapping=torch.arange(4),
        block_tables=torch.zeros(2, 1, dtype=torch.int32),
        seq_lens=torch.tensor([1, 3], dtype=torch.int32),
        query_start_loc=torch.tensor([0, 1, 4], dtype=torch.int32),
        num_decodes=1,
        num_decode_tokens=1,
        max_query_len=3,
    )
    return AttentionMetadata(**{**fields, **changes})


def test_attention_metadata_prefill_views():
    meta = _metadata()
    assert meta.prefill_query_start_loc.tolist() == [0, 3]
    assert meta.prefill_seq_lens.tolist() == [3]
    assert (meta.num_decodes, meta.num_prefills) == (1, 1)


@pytest.mark.parametrize(
    "changes, message",
    [
        (dict(query_start_loc=torch.tensor([0, 4], dtype=torch.int32)), "query_start_loc has 2"),
        (dict(block_tables=torch.zeros(3, 1, dtype=torch.int32)), "block_tables has 3 rows"),
        (dict(num_decodes=3, num_decode_tokens=3), "num_decodes 3"),
        (dict(num_decode_tokens=2), "num_decode_tokens 2"),
    ],
)
def test_attention_metadata_refuses_inconsistent_shapes(changes, message):
    with pytest.raises(ValueError, match=message):
        _metadata(**changes)
