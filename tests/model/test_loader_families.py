"""Loading Qwen3 and Phi-3 checkpoints: the fused Phi-3 tensors split per TP rank (each rank
reading only its rows), the per-head norms replicated, and every checkpoint these families
cannot serve refused at load, naming what is wrong."""

from __future__ import annotations

import pytest
import torch

from raypaged.model import parallel
from raypaged.model.config import ModelConfig, ModelConfigError
from raypaged.model.loader import CheckpointError, load_model
from tests.support.checkpoint_edits import checkpoint_state, edit_config, edit_tensors
from tests.support.checkpoints import checkpoint_dir, copy_checkpoint


@pytest.fixture(autouse=True)
def _single_rank():
    parallel.reset_tensor_parallel()
    yield
    parallel.reset_tensor_parallel()


def _load_rank(name: str, rank: int, tp: int):
    parallel.init_tensor_parallel(rank=rank, world_size=tp)
    try:
        return load_model(checkpoint_dir(name), dtype=torch.float32, progress=False)
    finally:
        parallel.reset_tensor_parallel()


def test_phi3_fused_tensors_split_per_rank():
    state = checkpoint_state("phi3")
    fused = state["model.layers.1.self_attn.qkv_proj.weight"]  # [q (4·16); k (2·16); v (2·16)]
    q, k, v = fused.split([64, 32, 32])
    gate, up = state["model.layers.1.mlp.gate_up_proj.weight"].chunk(2)
    for rank in range(2):
        layer = _load_rank("phi3", rank, 2).model.layers[1]
        rows = slice(32 * rank, 32 * (rank + 1)), slice(16 * rank, 16 * (rank + 1))
        expected_qkv = torch.cat([q[rows[0]], k[rows[1]], v[rows[1]]])
        torch.testing.assert_close(layer.self_attn.qkv_proj.weight, expected_qkv, rtol=0, atol=0)
        half = slice(64 * rank, 64 * (rank + 1))
        torch.testing.assert_close(
            layer.mlp.gate_up_proj.weight, torch.cat([gate[half], up[half]]), rtol=0, atol=0
        )


def test_qwen3_head_norms_are_replicated_and_heads_split():
    state = checkpoint_state("qwen3")
    for rank in range(2):
        attn = _load_rank("qwen3", rank, 2).model.layers[0].self_attn
        assert (attn.qkv_proj.num_heads, attn.qkv_proj.num_kv_heads) == (3, 1)
        for norm in ("q_norm", "k_norm"):
            torch.testing.assert_close(getattr(attn, norm).weight,
                                       state[f"model.layers.0.self_attn.{norm}.weight"],
                                       rtol=0, atol=0)  # fmt: skip


def _pop(name: str):
    return edit_tensors(lambda state: state.pop(name))


@pytest.mark.parametrize("name, edit, error, message", [
    ("qwen3", _pop("model.layers.1.self_attn.k_norm.weight"), CheckpointError,
     r"missing tensor in checkpoint: model\.layers\.1\.self_attn\.k_norm\.weight"),
    ("phi3", _pop("model.layers.0.self_attn.qkv_proj.weight"), CheckpointError,
     r"missing tensor in checkpoint: model\.layers\.0\.self_attn\.qkv_proj\.weight"),
    # An unfused projection beside the fused one: config.json does not describe the checkpoint.
    ("phi3", edit_tensors(lambda s: s.update({"model.layers.0.self_attn.q_proj.weight":
                                              torch.zeros(64, 64)})),
     CheckpointError, r"unexpected tensor in checkpoint .*model\.layers\.0\.self_attn\.q_proj"),
    # A Llama-layout (unfused) checkpoint labelled Phi-3.
    ("llama", edit_config(architectures=["Phi3ForCausalLM"]), CheckpointError,
     r"missing tensors in checkpoint: .*qkv_proj\.weight"),
    ("phi3", edit_config(num_key_value_heads=4), CheckpointError,
     r"qkv_proj\.weight' has shape \(128, 64\), expected \(192, 64\)"),
    ("qwen3", edit_config(architectures=["Qwen3MoeForCausalLM"]), ModelConfigError,
     r"unknown architecture \['Qwen3MoeForCausalLM'\]"),
    ("qwen3", edit_config(rope_parameters={"rope_type": "mrope", "rope_theta": 1e6}),
     ModelConfigError, "rope type 'mrope' is not supported"),
    ("phi3", edit_config(rope_parameters={"rope_type": "longrope", "short_factor": [1.0] * 8}),
     ModelConfigError, "longrope rope scaling is missing 'long_factor'"),
])  # fmt: skip
def test_unservable_checkpoints_fail_at_load_naming_the_problem(tmp_path, name, edit, error, message):
    path = copy_checkpoint(name, tmp_path / "m", edit)
    with pytest.raises(error, match=message):
        load_model(ModelConfig.from_pretrained(path, 64), dtype=torch.float32, progress=False)
