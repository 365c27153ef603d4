"""The safetensors loader: what it loads, what each TP rank reads, and how it refuses."""

from __future__ import annotations

import pytest
import torch

from raypaged.model import parallel
from raypaged.model.config import ModelConfig, ModelConfigError
from raypaged.model.loader import CheckpointError, load_model, load_weights, resolve_dtype
from tests.support.checkpoint_edits import checkpoint_state, edit_config, edit_tensors
from tests.support.checkpoints import checkpoint_dir, copy_checkpoint


@pytest.fixture(autouse=True)
def _single_rank():
    parallel.reset_tensor_parallel()
    yield
    parallel.reset_tensor_parallel()


def test_loaded_parameters_equal_checkpoint_tensors():
    model = load_model(checkpoint_dir("qwen2"), dtype=torch.float32, progress=False)
    state = checkpoint_state("qwen2")
    attn = model.model.layers[1].self_attn
    torch.testing.assert_close(
        attn.qkv_proj.weight,
        torch.cat([state[f"model.layers.1.self_attn.{p}_proj.weight"] for p in "qkv"]),
        rtol=0, atol=0,
    )  # fmt: skip
    torch.testing.assert_close(
        attn.qkv_proj.bias,
        torch.cat([state[f"model.layers.1.self_attn.{p}_proj.bias"] for p in "qkv"]),
        rtol=0, atol=0,
    )  # fmt: skip
    torch.testing.assert_close(model.lm_head.weight, state["lm_head.weight"], rtol=0, atol=0)


def test_sharded_checkpoint_loads_like_a_single_file():
    path = checkpoint_dir("llama-sharded")
    assert (path / "model.safetensors.index.json").exists()
    assert len(list(path.glob("*.safetensors"))) > 2
    model = load_model(path, dtype=torch.float32, progress=False)
    state = checkpoint_state("llama-sharded")
    torch.testing.assert_close(model.model.embed_tokens.weight, state["model.embed_tokens.weight"])
    torch.testing.assert_close(
        model.model.layers[1].mlp.gate_up_proj.weight,
        torch.cat([state["model.layers.1.mlp.gate_proj.weight"], state["model.layers.1.mlp.up_proj.weight"]]),
    )  # fmt: skip


def test_tied_embeddings_share_one_tensor():
    model = load_model(checkpoint_dir("llama-tied"), dtype=torch.float32, progress=False)
    assert model.lm_head.weight is model.model.embed_tokens.weight
    assert "lm_head.weight" not in checkpoint_state("llama-tied")


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_load_dtype_converts_fp32_checkpoint(dtype):
    model = load_model(checkpoint_dir("llama"), dtype=dtype, progress=False)
    state = checkpoint_state("llama")
    assert all(p.dtype == dtype for p in model.parameters())
    # rotary frequencies stay fp32 whatever the weights' dtype
    assert model.model.rotary_emb.inv_freq.dtype == torch.float32
    torch.testing.assert_close(
        model.model.layers[0].mlp.down_proj.weight,
        state["model.layers.0.mlp.down_proj.weight"].to(dtype),
        rtol=0, atol=0,
    )  # fmt: skip


def test_bf16_checkpoint_loads_as_fp32_and_auto_keeps_bf16():
    path = checkpoint_dir("llama-bf16")
    state = checkpoint_state("llama-bf16")
    assert state["model.norm.weight"].dtype == torch.bfloat16
    fp32 = load_model(path, dtype=torch.float32, progress=False)
    torch.testing.assert_close(fp32.model.norm.weight, state["model.norm.weight"].float(), rtol=0, atol=0)
    auto = load_model(path, dtype="auto", progress=False)
    assert auto.model.norm.weight.dtype == torch.bfloat16
    assert torch.get_default_dtype() == torch.float32  # the loader restores the default


def test_bad_load_dtype_is_refused():
    config = ModelConfig.from_pretrained(checkpoint_dir("llama"))
    with pytest.raises(CheckpointError, match="bad dtype"):
        resolve_dtype(torch.int8, config)
    with pytest.raises(CheckpointError, match="bad dtype 'float8'"):
        load_model(checkpoint_dir("llama"), dtype="float8", progress=False)
    assert resolve_dtype("bf16", config) == torch.bfloat16


def test_unknown_architecture_is_named(tmp_path):
    path = copy_checkpoint("llama", tmp_path / "m", edit_config(architectures=["GPT2LMHeadModel"]))
    with pytest.raises(ModelConfigError, match=r"unknown architecture \['GPT2LMHeadModel'\]"):
        load_model(path, dtype=torch.float32, progress=False)


def test_missing_tensor_is_named(tmp_path):
    name = "model.layers.1.self_attn.k_proj.weight"
    path = copy_checkpoint("llama", tmp_path / "m", edit_tensors(lambda s: s.pop(name)))
    with pytest.raises(CheckpointError, match=f"missing tensor in checkpoint: {name}"):
        load_model(path, dtype=torch.float32, progress=False)


def test_missing_bias_is_named(tmp_path):
    # A Llama checkpoint whose config claims biases it does not have.
    path = copy_checkpoint("llama", tmp_path / "m", edit_config(attention_bias=True))
    with pytest.raises(CheckpointError, match=r"missing tensors .*q_proj\.bias"):
        load_model(path, dtype=torch.float32, progress=False)


def test_wrong_shape_is_named(tmp_path):
    name = "model.layers.0.mlp.up_proj.weight"

    def shrink(state):
        state[name] = state[name][:-8].clone()

    path = copy_checkpoint("llama", tmp_path / "m", edit_tensors(shrink))
    with pytest.raises(CheckpointError, match=rf"{name}' has shape \(120, 64\), expected \(128, 64\)"):
        load_model(path, dtype=torch.float32, progress=False)


def test_config_that_disagrees_with_weights_is_refused(tmp_path):
    path = copy_checkpoint("llama", tmp_path / "m", edit_config(intermediate_size=96))
    with pytest.raises(CheckpointError, match=r"expected \(96, 64\) from config.json"):
        load_model(path, dtype=torch.float32, progress=False)


def test_unexpected_tensor_is_named(tmp_path):
    path = copy_checkpoint("llama", tmp_path / "m", edit_config(num_hidden_layers=1))
    with pytest.raises(CheckpointError, match=r"unexpected tensors .*model\.layers\.1\."):
        load_model(path, dtype=torch.float32, progress=False)


def test_unsupported_checkpoint_dtype_is_named(tmp_path):
    name = "model.norm.weight"

    def quantise(state):
        state[name] = state[name].to(torch.int8)

    path = copy_checkpoint("llama", tmp_path / "m", edit_tensors(quantise))
    with pytest.raises(CheckpointError, match=f"tensor '{name}' has dtype I8"):
        load_model(path, dtype=torch.float32, progress=False)


def test_directory_without_safetensors_is_refused(tmp_path):
    path = copy_checkpoint(
        "llama", tmp_path / "m", lambda p: (p / "model.safetensors").rename(p / "weights.bin")
    )
    with pytest.raises(CheckpointError, match="no safetensors weights"):
        load_model(path, dtype=torch.float32, progress=False)


def test_unknown_load_format_is_refused():
    with pytest.raises(CheckpointError, match="unknown load_format 'pt'"):
        load_model(checkpoint_dir("llama"), load_format="pt", progress=False)


# -- tensor-parallel shards, loaded in-process (no collectives needed to load) ----------------


def _load_rank(name: str, rank: int, tp: int, **kwargs):
    parallel.init_tensor_parallel(rank=rank, world_size=tp)
    try:
        return load_model(checkpoint_dir(name), dtype=torch.float32, progress=False, **kwargs)
    finally:
        parallel.reset_tensor_parallel()


def test_each_rank_holds_its_slices():
    full = load_model(checkpoint_dir("llama-tied"), dtype=torch.float32, progress=False)
    ranks = [_load_rank("llama-tied", r, 2) for r in range(2)]
    for name, param in full.named_parameters():
        shards = [dict(m.named_parameters())[name] for m in ranks]
        if "down_proj.weight" in name or "o_proj.weight" in name:
            merged = torch.cat(shards, dim=1)  # row-parallel: input columns split
        elif param.dim() == 1 and ("norm" in name or "o_proj" in name or "down_proj" in name):
            merged = shards[0]  # replicated
            torch.testing.assert_close(shards[1], shards[0], rtol=0, atol=0)
        elif "qkv_proj" in name:  # per-rank [q_r; k_r; v_r] -> [q; k; v]
            q, kv = 2 * 32, 1 * 32  # 2 query heads and 1 KV head per rank, head_dim 32
            parts = [s.split([q, kv, kv]) for s in shards]
            merged = torch.cat([torch.cat([p[i] for p in parts]) for i in range(3)])
        elif "gate_up_proj" in name:
            parts = [s.chunk(2) for s in shards]
            merged = torch.cat([torch.cat([p[i] for p in parts]) for i in range(2)])
        else:
            merged = torch.cat(shards)  # vocab rows
        torch.testing.assert_close(merged, param, rtol=0, atol=0, msg=name)


@pytest.mark.parametrize("name", ["llama", "phi3"])  # phi3: its rows of the fused tensors
def test_rank_reads_only_its_share_of_the_checkpoint(name):
    path = checkpoint_dir(name)
    one = load_weights(load_model(path, load_format="dummy", progress=False), path, progress=False)
    parallel.init_tensor_parallel(rank=1, world_size=2)
    half = load_weights(load_model(path, load_format="dummy", progress=False), path, progress=False)
    replicated = 5 * 64 * 4  # five RMSNorm weights (fp32) are read whole by every rank
    assert half.bytes_read == (one.bytes_read - replicated) // 2 + replicated


def test_kv_head_replicated_when_tp_exceeds_kv_heads():
    # llama3-rope has 4 query heads and 1 KV head: at tp = 2 both ranks keep KV head 0.
    config = ModelConfig.from_pretrained(checkpoint_dir("llama3-rope"))
    assert config.num_kv_heads_per_rank(2) == 1
    state = checkpoint_state("llama3-rope")
    k = state["model.layers.0.self_attn.k_proj.weight"]
    for rank in range(2):
        qkv = _load_rank("llama3-rope", rank, 2).model.layers[0].self_attn.qkv_proj
        assert (qkv.num_heads, qkv.num_kv_heads) == (2, 1)
        torch.testing.assert_close(qkv.weight[32:48], k, rtol=0, atol=0)


def test_query_heads_not_divisible_by_tp_is_refused():
    with pytest.raises(ModelConfigError, match="num_attention_heads 4 is not divisible by tensor_parallel_size 3"):
        _load_rank("llama", 0, 3)


# -- dummy weights ---------------------------------------------------------------------------


def test_dummy_weights_are_seeded_and_tp_consistent():
    path = checkpoint_dir("llama")
    a = load_model(path, load_format="dummy", seed=7, progress=False)
    b = load_model(path, load_format="dummy", seed=7, progress=False)
    c = load_model(path, load_format="dummy", seed=8, progress=False)
    for (name, pa), pb, pc in zip(a.named_parameters(), b.parameters(), c.parameters()):
        torch.testing.assert_close(pa, pb, rtol=0, atol=0, msg=name)
        assert not torch.equal(pa, pc), name
        assert torch.isfinite(pa).all(), name
    ranks = [_load_rank("llama", r, 2, load_format="dummy", seed=7) for r in range(2)]
    torch.testing.assert_close(
        torch.cat([m.model.layers[0].mlp.down_proj.weight for m in ranks], dim=1),
        a.model.layers[0].mlp.down_proj.weight,
        rtol=0, atol=0,
    )  # fmt: skip
