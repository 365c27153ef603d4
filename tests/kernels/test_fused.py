"""The elementwise Triton kernels (RMSNorm with the residual add, Gemma's (1 + weight) variant,
SiLU·mul and GeGLU, rope; run here under
TRITON_INTERPRET=1) against their torch references (kernels/reference.py: transformers'
arithmetic for the norm and the activation), then through ops and the model's rope, then the
whole model through the Triton backend against transformers."""

from __future__ import annotations

import pytest
import torch

from raypaged.kernels import ops, reference
from raypaged.kernels.activation import gelu_tanh_and_mul_triton, silu_and_mul_triton
from raypaged.kernels.norm import add_rms_norm_triton, rms_norm_triton
from raypaged.kernels.rope import rope_in_place_triton, rope_tables_triton
from raypaged.model.config import ModelConfig, RopeConfig
from raypaged.model.loader import load_model
from raypaged.model.rotary import RotaryEmbedding, rope_inverse_frequencies
from tests.support.checkpoints import checkpoint_dir
from tests.support.model_harness import PagedHarness, run_mixed_schedule

# fp32: the same math up to summation order. bf16: the fused kernels round once, the torch
# versions after every op, so they may differ by a rounding step or two.
TOLERANCE = {torch.float32: {"rtol": 1e-5, "atol": 1e-5}, torch.bfloat16: {"rtol": 2e-2, "atol": 2e-2}}


@pytest.fixture
def triton_path():
    ops.set_backend("triton")
    yield
    ops.set_backend("auto")


def _randn(*shape, dtype, seed=0):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed)).to(dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("hidden", [64, 96])
def test_rms_norm_and_residual_add_match_torch(dtype, hidden):
    x = _randn(5, hidden + 8, dtype=dtype)[:, :hidden]  # rows strided, like a view
    residual = _randn(5, hidden, dtype=dtype, seed=1)
    weight = _randn(hidden, dtype=dtype, seed=2)
    expected = reference.rms_norm_ref(x, weight, 1e-5)
    expected_add, expected_sum = reference.add_rms_norm_ref(x, residual, weight, 1e-5)
    out = rms_norm_triton(x, weight, 1e-5)
    out_add, summed = add_rms_norm_triton(x, residual, weight, 1e-5)
    assert out.dtype == dtype and summed.dtype == dtype
    torch.testing.assert_close(out, expected, **TOLERANCE[dtype])
    # (bf16: the interpreter's fp32 -> bf16 conversion may truncate where a GPU rounds)
    torch.testing.assert_close(summed, expected_sum, **TOLERANCE[dtype])
    torch.testing.assert_close(out_add, expected_add, **TOLERANCE[dtype])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_gemma_rms_norm_scales_by_one_plus_weight_and_rounds_once(dtype):
    from transformers.models.gemma2.modeling_gemma2 import Gemma2RMSNorm

    x = (_randn(5, 72, dtype=dtype) * 3)[:, :64]  # rows strided, like a view
    residual = _randn(5, 64, dtype=dtype, seed=1)
    weight = _randn(64, dtype=dtype, seed=2) * 0.5
    theirs = Gemma2RMSNorm(64, eps=1e-6).to(dtype)
    theirs.weight.data.copy_(weight)
    with torch.no_grad():
        expected, expected_add = theirs(x), theirs(residual + x)
    torch.testing.assert_close(reference.gemma_rms_norm_ref(x, weight, 1e-6), expected, rtol=0, atol=0)
    out = rms_norm_triton(x, weight, 1e-6, unit_offset=True)
    out_add, summed = add_rms_norm_triton(x, residual, weight, 1e-6, unit_offset=True)
    assert out.dtype == dtype and out_add.dtype == dtype
    torch.testing.assert_close(out, expected, **TOLERANCE[dtype])
    torch.testing.assert_close(summed, residual + x, **TOLERANCE[dtype])
    torch.testing.assert_close(out_add, expected_add, **TOLERANCE[dtype])
    # Not Llama's arithmetic: (1 + weight), and no rounding before the weight.
    assert not torch.allclose(out, reference.rms_norm_ref(x, weight, 1e-6), rtol=0.1, atol=0.1)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("cols", [40, 1100])
def test_gelu_tanh_and_mul_matches_torch(dtype, cols):
    gate_up = _randn(3, 2 * cols, dtype=dtype) * 4  # |gate| up to ~12: tanh saturates
    gate, up = gate_up.chunk(2, dim=-1)
    expected = torch.nn.functional.gelu(gate, approximate="tanh") * up
    torch.testing.assert_close(reference.gelu_tanh_and_mul_ref(gate_up), expected, rtol=0, atol=0)
    torch.testing.assert_close(gelu_tanh_and_mul_triton(gate_up), expected, **TOLERANCE[dtype])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("cols", [40, 1100])  # 1100: more than one column block per row
def test_silu_and_mul_matches_torch(dtype, cols):
    gate_up = _randn(3, 2 * cols, dtype=dtype)
    gate, up = gate_up.chunk(2, dim=-1)
    expected = torch.nn.functional.silu(gate) * up
    torch.testing.assert_close(reference.silu_and_mul_ref(gate_up), expected, rtol=0, atol=0)
    torch.testing.assert_close(silu_and_mul_triton(gate_up), expected, **TOLERANCE[dtype])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("head_dim", [16, 24])  # 24: half of it is not a power of two
def test_rope_tables_and_rotation_match_torch(dtype, head_dim):
    tokens, q_heads, kv_heads = 6, 4, 2
    positions = torch.tensor([0, 1, 7, 100, 3000, 5])
    inv_freq = rope_inverse_frequencies(head_dim, RopeConfig(theta=10000.0))
    cos, sin = rope_tables_triton(positions, inv_freq)
    expected_cos, expected_sin = reference.rope_tables_ref(positions, inv_freq)
    assert cos.dtype == torch.float32 and cos.shape == (tokens, head_dim // 2)
    torch.testing.assert_close(cos, expected_cos, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(sin, expected_sin, rtol=1e-5, atol=1e-5)

    q = _randn(tokens, q_heads, head_dim, dtype=dtype) * 3
    k = _randn(tokens, kv_heads, head_dim, dtype=dtype, seed=1) * 3
    expected_q, expected_k = q.clone(), k.clone()
    reference.rope_in_place_ref(expected_q, expected_k, expected_cos, expected_sin)
    rope_in_place_triton(q, k, cos, sin)
    torch.testing.assert_close(q, expected_q, **TOLERANCE[dtype])
    torch.testing.assert_close(k, expected_k, **TOLERANCE[dtype])


def test_ops_dispatch_the_elementwise_steps_by_the_one_backend_switch(monkeypatch):
    from raypaged.kernels import activation, norm, rope

    calls = []
    for module, name in ((norm, "rms_norm_triton"), (norm, "add_rms_norm_triton"),
                         (activation, "silu_and_mul_triton"), (rope, "rope_tables_triton"),
                         (rope, "rope_in_place_triton")):
        original = getattr(module, name)
        monkeypatch.setattr(ops, name, lambda *a, _n=name, _f=original: (calls.append(_n), _f(*a))[1])
    x, weight = _randn(2, 8, dtype=torch.float32), _randn(8, dtype=torch.float32, seed=1)
    q, k = _randn(2, 2, 8, dtype=torch.float32), _randn(2, 1, 8, dtype=torch.float32, seed=2)
    positions, inv_freq = torch.tensor([3, 4]), rope_inverse_frequencies(8, RopeConfig(theta=1e4))

    def run_all():
        cos, sin = ops.rope_tables(positions, inv_freq)
        ops.rope_in_place(q, k, cos, sin)
        return ops.rms_norm(x, weight, 1e-5), ops.add_rms_norm(x, x, weight, 1e-5), ops.silu_and_mul(x)

    torch_results = run_all()  # CPU tensors: the references
    assert calls == []
    ops.set_backend("triton")
    try:
        triton_results = run_all()
    finally:
        ops.set_backend("auto")
    assert len(calls) == 5
    torch.testing.assert_close(triton_results, torch_results, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("head_dim", [16, 24])
def test_rope_in_place_matches_torch_rotation(dtype, head_dim):
    """The model's rope on the kernels' path (in place, inside the qkv output) against its torch
    path (transformers' arithmetic)."""
    tokens, q_heads, kv_heads = 6, 4, 2
    qkv = _randn(tokens, (q_heads + 2 * kv_heads) * head_dim, dtype=dtype) * 3
    q_rows, kv_rows = q_heads * head_dim, kv_heads * head_dim
    positions = torch.tensor([0, 1, 7, 100, 3000, 5])
    rope = RotaryEmbedding(head_dim, RopeConfig(theta=10000.0))

    def views(t):
        q, k, v = t.split([q_rows, kv_rows, kv_rows], dim=-1)
        return (q.view(tokens, q_heads, head_dim), k.view(tokens, kv_heads, head_dim),
                v.view(tokens, kv_heads, head_dim))  # fmt: skip

    q, k, v = views(qkv.clone())
    expected_q, expected_k = rope(positions, dtype).apply(q, k)
    q, k, v = views(qkv)
    v_before = v.clone()
    ops.set_backend("triton")
    try:
        step = rope(positions, dtype)
        assert step.on_kernels and step.cos.shape == (tokens, head_dim // 2)  # the tables
        out_q, out_k = step.apply(q, k)
    finally:
        ops.set_backend("auto")
    assert out_q.data_ptr() == q.data_ptr()  # rotated in place, inside qkv
    torch.testing.assert_close(out_q, expected_q, **TOLERANCE[dtype])
    torch.testing.assert_close(out_k, expected_k, **TOLERANCE[dtype])
    torch.testing.assert_close(v, v_before, rtol=0, atol=0)  # v untouched


@pytest.mark.parametrize("name", ["qwen2", "gemma2", "gemma3"])  # Gemma: its norms and GeGLU
def test_model_through_fused_kernels_matches_transformers(name, triton_path):
    _model_matches_transformers(name)


@pytest.mark.parametrize("name", ["qwen2", "llama3-rope", "llama-tied"])
def test_model_through_gemm_epilogues_matches_transformers(name, triton_path, monkeypatch):
    # The decode path of a GPU: the linears on the skinny GEMM, rope and SwiGLU in its epilogues
    # (qkv bias, llama3 frequencies, one KV head, tied embeddings with MLP biases).
    from raypaged.kernels import gemv, gemv_config

    # Every step fuses, with the default config as if a tuned table had it (the CPU has none).
    monkeypatch.setattr(gemv_config, "EPILOGUE_MIN_ROWS", 1)
    monkeypatch.setattr(gemv_config, "tuned_entry", lambda x, w: {"backend": "cublas",
                                                                   "config": gemv_config.default_for(x, w)})
    calls = {"gemv_rope": 0, "gemv_silu_mul": 0}
    for fn in calls:
        original = getattr(gemv, fn)
        monkeypatch.setattr(gemv, fn, lambda *a, _fn=fn, _original=original, **k: (
            calls.__setitem__(_fn, calls[_fn] + 1), _original(*a, **k))[1])
    _model_matches_transformers(name)
    layers = ModelConfig.from_pretrained(checkpoint_dir(name)).num_hidden_layers
    assert calls["gemv_rope"] >= 3 * layers and calls["gemv_silu_mul"] >= 3 * layers, calls


def _model_matches_transformers(name: str) -> None:
    from transformers import AutoModelForCausalLM

    path = checkpoint_dir(name)
    config = ModelConfig.from_pretrained(path)
    model = load_model(path, dtype=torch.float32, progress=False)
    harness = PagedHarness(model, config, block_size=8, num_blocks=24, seed=4)
    generator = torch.Generator().manual_seed(9)
    prompts = {
        f"req{i}": torch.randint(3, config.vocab_size, (n,), generator=generator).tolist()
        for i, n in enumerate((4, 13))
    }
    generated = run_mixed_schedule(harness, prompts, decode_steps=3, chunk="req1")
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    for req, prompt in prompts.items():
        tokens = harness.tokens[req][: harness.num_computed[req]]
        with torch.no_grad():
            expected = hf(torch.tensor([tokens])).logits[0]
        torch.testing.assert_close(harness.logits_of(req), expected, rtol=1e-4, atol=1e-4)
        assert generated[req] == expected[len(prompt) - 1 :].argmax(-1).tolist()[: len(generated[req])]
