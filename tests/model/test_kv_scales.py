"""The FP8 KV cache's per-layer scales through the loader (model/kv_scales.py), and what they
buy: the model's logits over an e4m3 pool stay close to a float pool's."""

from __future__ import annotations

import logging

import pytest
import torch
from safetensors.torch import load_file, save_file

from raypaged.model.config import ModelConfig
from raypaged.model.kv_scales import attention_layers
from raypaged.model.loader import CheckpointError, load_model
from tests.support.checkpoints import checkpoint_dir, copy_checkpoint
from tests.support.hf_oracle import random_prompts, vocab_of
from tests.support.kv_scale_checkpoints import MARGIN, NAMINGS, kv_amax, kv_scaled_dir
from tests.support.model_harness import PagedHarness


def _scales(model) -> list[float]:
    """k, v, k, v, ... of the layers in order."""
    return [float(s) for a in attention_layers(model) for s in (a.k_scale, a.v_scale)]


def _expected(naming: str) -> list[float]:
    pairs = [(MARGIN * k / 448, MARGIN * v / 448) for k, v in kv_amax("llama")]
    if len(NAMINGS[naming]) == 1:  # one kv_scale for both
        pairs = [(max(p),) * 2 for p in pairs]
    return [s for p in pairs for s in p]


@pytest.mark.parametrize("naming", list(NAMINGS))
def test_an_e4m3_pool_reads_the_checkpoint_scales_under_each_tools_names(naming):
    model = load_model(kv_scaled_dir(naming), kv_cache_dtype="fp8", progress=False)
    assert _scales(model) == pytest.approx(_expected(naming), rel=1e-6)
    assert all(a.k_scale.dtype == torch.float32 for a in attention_layers(model))


@pytest.mark.parametrize("kv_cache_dtype", ["auto", "fp8_e5m2"])
def test_float_and_e5m2_pools_leave_the_scales_at_one(kv_cache_dtype, caplog):
    with caplog.at_level(logging.WARNING):
        model = load_model(kv_scaled_dir(), kv_cache_dtype=kv_cache_dtype, progress=False)
    assert _scales(model) == [1.0] * 4
    assert "no k/v scales" not in caplog.text


def test_a_checkpoint_without_scales_gives_one_and_a_warning(caplog):
    with caplog.at_level(logging.WARNING):
        model = load_model(checkpoint_dir("llama"), kv_cache_dtype="fp8", progress=False)
    assert _scales(model) == [1.0] * 4
    assert "no k/v scales for 2 of 2 layers" in caplog.text


@pytest.mark.parametrize("value, match", [(torch.tensor(0.0), "positive"),
                                          (torch.tensor([0.1, 0.2]), "shape")])
def test_a_bad_scale_is_an_error_naming_it(tmp_path, value, match):
    def edit(path):
        (weights,) = path.glob("*.safetensors")
        tensors = load_file(weights)
        tensors["model.layers.1.self_attn.k_scale"] = value
        save_file(tensors, weights, metadata={"format": "pt"})

    with pytest.raises(CheckpointError, match=match) as info:
        load_model(copy_checkpoint("llama", tmp_path / "bad", edit), kv_cache_dtype="fp8",
                   progress=False)
    assert "layers.1.self_attn.k_scale" in str(info.value)


def _logits(model_dir, pool_dtype, prompt) -> torch.Tensor:
    config = ModelConfig.from_pretrained(model_dir)
    kv = "fp8" if pool_dtype == torch.float8_e4m3fn else "auto"
    model = load_model(config, kv_cache_dtype=kv, progress=False)
    harness = PagedHarness(model, config, block_size=8, dtype=pool_dtype)
    harness.add_tokens("a", prompt)
    harness.step({"a": 20})
    for _ in range(len(prompt) - 20):  # the rest one token at a time: decode reads the pool
        harness.step({"a": 1})
    return harness.logits_of("a")


def test_logits_over_an_e4m3_pool_stay_close_to_a_float_pools():
    prompt = random_prompts([28], vocab_of("llama"), seed=21)[0]
    exact = _logits(checkpoint_dir("llama"), torch.float32, prompt)
    calibrated = _logits(kv_scaled_dir(), torch.float8_e4m3fn, prompt)
    unit_scales = _logits(checkpoint_dir("llama"), torch.float8_e4m3fn, prompt)

    def error(logits):
        return float((logits - exact).norm() / exact.norm())

    assert torch.isfinite(calibrated).all()
    assert error(calibrated) < 0.05
    # This model's K/V are far below 448: scale 1.0 leaves them in e4m3's coarse subnormals.
    assert error(calibrated) < error(unit_scales)
    agree = (calibrated.argmax(-1) == exact.argmax(-1)).float().mean()
    assert agree >= 0.85
