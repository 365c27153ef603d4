"""Gemma's pieces against transformers' own modules, in fp32 and bf16 (where the order of
rounding shows): RMSNorm (1 + weight), the √hidden embedding scale, GeGLU."""

from __future__ import annotations

import pytest
import torch

from raypaged.model.gemma_layers import GeGLUMLP, GemmaRMSNorm, ScaledEmbedding


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rms_norm_is_transformers_gemma2_rms_norm(dtype):
    from transformers.models.gemma2.modeling_gemma2 import Gemma2RMSNorm

    gen = torch.Generator().manual_seed(0)
    x = (torch.randn(5, 3, 48, generator=gen) * 3).to(dtype)
    weight = (torch.randn(48, generator=gen) * 0.5).to(dtype)
    theirs = Gemma2RMSNorm(48, eps=1e-6).to(dtype)
    theirs.weight.data.copy_(weight)
    with torch.device("cpu"):
        ours = GemmaRMSNorm(48, 1e-6).to(dtype)
    ours.weight.data.copy_(weight)
    assert torch.equal(ours(x), theirs(x))
    residual = torch.randn(5, 3, 48, generator=gen).to(dtype)
    normed, summed = ours.add_and_norm(x, residual)
    assert torch.equal(summed, residual + x) and torch.equal(normed, theirs(residual + x))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_embedding_scale_is_rounded_to_the_model_dtype(dtype):
    from transformers.models.gemma2.modeling_gemma2 import Gemma2TextScaledWordEmbedding

    hidden = 3072  # √3072 = 55.43, 55.5 in bf16
    weight = torch.randn(11, hidden, generator=torch.Generator().manual_seed(1)).to(dtype)
    theirs = Gemma2TextScaledWordEmbedding(11, hidden, padding_idx=0, embed_scale=hidden**0.5)
    theirs = theirs.to(dtype)
    theirs.weight.data.copy_(weight)
    with torch.device("cpu"):
        torch.set_default_dtype(dtype)
        try:
            ours = ScaledEmbedding(11, hidden)
        finally:
            torch.set_default_dtype(torch.float32)
    ours.weight.data.copy_(weight)
    ids = torch.tensor([0, 3, 10, 3])
    assert ours.normalizer.dtype == dtype
    assert torch.equal(ours(ids), theirs(ids))


def test_geglu_is_transformers_gemma2_mlp():
    from transformers import Gemma2Config
    from transformers.models.gemma2.modeling_gemma2 import Gemma2MLP

    config = Gemma2Config(hidden_size=16, intermediate_size=40, num_attention_heads=2, head_dim=8)
    theirs = Gemma2MLP(config)
    ours = GeGLUMLP(16, 40)
    ours.gate_up_proj.weight.data.copy_(torch.cat([theirs.gate_proj.weight, theirs.up_proj.weight]))
    ours.down_proj.weight.data.copy_(theirs.down_proj.weight)
    x = torch.randn(7, 16, generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        torch.testing.assert_close(ours(x), theirs(x), rtol=1e-6, atol=1e-6)
