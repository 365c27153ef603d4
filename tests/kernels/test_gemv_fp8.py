"""The skinny GEMM over an e4m3 weight with rope / SwiGLU in its epilogue (kernels/gemv_fp8.py),
under the interpreter, against the torch reference: the weight-only product (rows unquantized,
the e4m3 weight widened, fp32 sums scaled per feature, bias added), rounded to the rows' dtype,
then rope_in_place_ref / silu_and_mul_ref. Which steps take it (w8a16_epilogue_config), and that
Fp8Linear's qkv / gate-up seams use it on the Triton backend."""

from __future__ import annotations

import pytest
import torch

from raypaged.kernels import gemv_config, gemv_fp8, ops
from raypaged.kernels.gemv_config import default_config
from raypaged.kernels.gemv_fp8 import (
    gemv_w8a16,
    gemv_w8a16_rope,
    gemv_w8a16_silu_mul,
    w8a16_config,
    w8a16_epilogue_config,
)
from raypaged.kernels.reference import rope_in_place_ref, rope_tables_ref, silu_and_mul_ref
from raypaged.model.quantization.fp8 import Fp8Linear
from raypaged.model.quantization.numerics import quantize_weight, weight_only_matmul_reference

SMALL = dict(block_n=32, block_k=32, num_warps=4, num_stages=2, split_k=1)


def _operands(rows: int, out_features: int, dtype: torch.dtype, bias: bool, seed: int = 0, in_features: int = 96,
              device: str = "cpu"):
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(rows, in_features, generator=gen).to(dtype).to(device)
    wq, scale = quantize_weight(torch.randn(out_features, in_features, generator=gen) * 0.1)
    b = torch.randn(out_features, generator=gen).to(dtype).to(device) if bias else None
    return x, wq.to(device), scale.to(device), b


def _product(x, wq, scale, b) -> torch.Tensor:
    """The reference weight-only product, rounded to the rows' dtype as the kernel stores it."""
    out = weight_only_matmul_reference(x, wq, scale)
    return (out + b.float() if b is not None else out).to(x.dtype)


def _tables(rows: int, head_dim: int, device: str = "cpu") -> tuple[torch.Tensor, torch.Tensor]:
    positions = torch.randint(0, 5000, (rows,), generator=torch.Generator().manual_seed(1))
    inv_freq = 1.0 / 10000 ** (torch.arange(0, head_dim, 2).float() / head_dim)
    return rope_tables_ref(positions.to(device), inv_freq.to(device))


def _assert_close(out: torch.Tensor, expected: torch.Tensor) -> None:
    """Against the reference from the reference's product. fp32: summation order only. bf16:
    the kernel's fp32 sums and torch's may round the product to neighbouring bf16 values, which
    SwiGLU's two factors and rope's a·cos − b·sin (which can cancel) carry on, so a few steps
    of the block's magnitude; a wrong scale, pair or table is off by the values themselves."""
    assert out.dtype == expected.dtype and out.shape == expected.shape
    if out.dtype == torch.float32:
        torch.testing.assert_close(out, expected, rtol=1e-5, atol=1e-5)
        return
    torch.testing.assert_close(out.float(), expected.float(), rtol=2.0**-5,
                               atol=2.0**-6 * float(expected.float().abs().max()))


def _assert_rounding(out: torch.Tensor, expected: torch.Tensor) -> None:
    """Against the reference step applied to the plain kernel's own product (the same sums):
    only the step's roundings may differ (SwiGLU rounds silu(gate), then its product with up),
    two steps of the output's dtype at most."""
    step = expected.float().abs() * (2.0**-6 if out.dtype == torch.bfloat16 else 1e-6) + 1e-6
    assert ((out.float() - expected.float()).abs() <= step).all()


def check_rope(rows, q_heads, kv_heads, head_dim, dtype, bias, config, device="cpu", in_features=96):
    x, wq, scale, b = _operands(rows, (q_heads + 2 * kv_heads) * head_dim, dtype, bias, device=device,
                                in_features=in_features)
    cos, sin = _tables(rows, head_dim, device)
    expected = _product(x, wq, scale, b)
    q, k, _ = expected.split([q_heads * head_dim, kv_heads * head_dim, kv_heads * head_dim], -1)
    rope_in_place_ref(q.view(rows, q_heads, head_dim), k.view(rows, kv_heads, head_dim), cos, sin)
    out = gemv_w8a16_rope(x, wq, scale, b, cos, sin, head_dim, (q_heads + kv_heads) * head_dim, config)
    _assert_close(out, expected)
    # Against the plain kernel's own product then the reference rope: the same sums, so only
    # rope's rounding may differ (the tight check of which feature pairs with which).
    plain = gemv_w8a16(x, wq, scale, b, config)
    q, k, _ = plain.split([q_heads * head_dim, kv_heads * head_dim, kv_heads * head_dim], -1)
    rope_in_place_ref(q.view(rows, q_heads, head_dim), k.view(rows, kv_heads, head_dim), cos, sin)
    _assert_rounding(out, plain)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rows,block_n,split_k,bias", [(1, 32, 1, True), (5, 16, 2, False), (16, 32, 1, False)])
def test_rope_epilogue_is_the_weight_only_product_then_rope(dtype, rows, block_n, split_k, bias):
    config = dict(SMALL, block_n=block_n, split_k=split_k)
    check_rope(rows, 4, 2, 32, dtype, bias, config)  # a block of 32: one head; of 16: half of one
    check_rope(rows, 3, 1, 16, dtype, bias, dict(config, block_n=16))  # MQA, one kv head


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rows,block_n,split_k,bias", [(1, 32, 1, True), (7, 16, 2, False)])
def test_silu_epilogue_is_the_weight_only_product_then_silu_and_mul(dtype, rows, block_n, split_k, bias):
    check_silu(rows, 48, dtype, bias, dict(SMALL, block_n=block_n, split_k=split_k))


def check_silu(rows, intermediate, dtype, bias, config, device="cpu", in_features=96):
    x, wq, scale, b = _operands(rows, 2 * intermediate, dtype, bias, seed=2, device=device, in_features=in_features)
    out = gemv_w8a16_silu_mul(x, wq, scale, b, config)
    assert out.shape == (rows, intermediate)
    _assert_close(out, silu_and_mul_ref(_product(x, wq, scale, b)))
    _assert_rounding(out, silu_and_mul_ref(gemv_w8a16(x, wq, scale, b, config)))


def test_epilogues_equal_the_plain_kernel_then_the_step():
    """The same kernel with and without the epilogue: identical sums, so the silu epilogue equals
    gemv_w8a16 then silu_and_mul_ref to the output's rounding of silu."""
    x, wq, scale, _ = _operands(3, 96, torch.float32, False, seed=5)
    plain = gemv_w8a16(x, wq, scale, None, SMALL)
    fused = gemv_w8a16_silu_mul(x, wq, scale, None, SMALL)
    torch.testing.assert_close(fused, silu_and_mul_ref(plain), rtol=1e-6, atol=1e-6)


def test_epilogue_config_takes_the_weight_only_steps_and_pairs_features():
    wq, _ = quantize_weight(torch.randn(192, 64))
    plain = w8a16_config(torch.zeros(1, 64), wq)
    assert plain is not None and plain["block_n"] == 64
    assert w8a16_epilogue_config(torch.zeros(1, 64), wq, 96, "silu") == dict(plain, block_n=64)
    assert w8a16_epilogue_config(torch.zeros(16, 64), wq, 16, "rope")["block_n"] == 32  # pairs 16 apart
    assert w8a16_epilogue_config(torch.zeros(1, 64), wq, 4, "rope") is None  # no block of >= 16 pairs it
    assert w8a16_epilogue_config(torch.zeros(17, 64), wq, 96, "silu") is None  # past the kernel's rows
    assert w8a16_epilogue_config(torch.zeros(1, 64, dtype=torch.float64), wq, 96, "silu") is None
    gemv_config.set_epilogues(False)
    try:
        assert w8a16_epilogue_config(torch.zeros(1, 64), wq, 96, "silu") is None
    finally:
        gemv_config.set_epilogues(True)


def test_epilogue_config_declines_where_the_table_chose_the_one_row_kernel(monkeypatch):
    """The one-row CUDA-core kernel has no epilogue and beat the tensor-core kernel there: those
    steps keep it and run rope / SwiGLU separately."""
    wq, _ = quantize_weight(torch.randn(192, 64))
    row = {"kernel": gemv_fp8.ROW_KERNEL, "block_n": 16, "block_k": 256, "num_warps": 4, "num_stages": 2}
    monkeypatch.setattr(gemv_fp8, "w8a16_config", lambda x, weight: dict(row))
    assert w8a16_epilogue_config(torch.zeros(1, 64), wq, 96, "silu") is None


def test_epilogues_refuse_what_they_cannot_pair_or_take():
    x, wq, scale, _ = _operands(2, 96, torch.float32, False)
    with pytest.raises(ValueError, match="pair"):
        gemv_w8a16_silu_mul(x, wq, scale, None, dict(SMALL, block_n=64))  # 48 % 32
    cos, sin = _tables(2, 32)
    with pytest.raises(ValueError, match="rope tables"):
        gemv_w8a16_rope(x, wq, scale, None, cos[:1], sin[:1], 32, 64, SMALL)
    with pytest.raises(ValueError, match="weight scales"):
        gemv_w8a16_silu_mul(x, wq, scale[:-1], None, SMALL)
    with pytest.raises(ValueError, match="e4m3"):
        gemv_w8a16_silu_mul(x, wq.float(), scale, None, SMALL)


def test_fp8_linear_fuses_rope_and_swiglu_on_the_triton_backend():
    """Fp8Linear's seams (the qkv layer's `rotated`, the gate/up layer's `silu_and_mul` call them):
    on the Triton backend a decode step's rows take the fused kernels and equal the reference's
    weight-only product then the step; on the torch backend they decline (None)."""
    x, wq, scale, _ = _operands(4, 2 * 64, torch.float32, False, seed=7, in_features=64)
    method = Fp8Linear(wq.shape[0])
    method.weight_scale.copy_(scale)
    cos, sin = _tables(4, 32)
    assert method.matmul_silu_mul(x, wq, None) is None and method.matmul_rope(x, wq, None, cos, sin, 32, 96) is None
    ops.set_backend("triton")
    try:
        activated = method.matmul_silu_mul(x, wq, None)
        rotated = method.matmul_rope(x, wq, None, cos, sin, 32, 96)
    finally:
        ops.set_backend("auto")
    product = _product(x, wq, scale, None)
    assert activated is not None and rotated is not None
    _assert_close(activated, silu_and_mul_ref(product))
    expected = product.clone()
    q, k, _ = expected.split([64, 32, 32], -1)
    rope_in_place_ref(q.view(4, 2, 32), k.view(4, 1, 32), cos, sin)
    _assert_close(rotated, expected)


@pytest.mark.slow  # the interpreter runs the paged kernels too
def test_fp8_decoder_takes_the_fused_epilogues_and_matches_the_separate_kernels(monkeypatch):
    """The whole decoder with FP8 weights on the Triton backend (interpreter): with epilogues on,
    decode steps go through the fused rope and SwiGLU kernels, and tokens and logits equal those
    of the same backend with the epilogues off (the weight-only GEMM, then rope and SwiGLU as
    their own kernels) to fp32 rounding. (The torch backend is no oracle here: it runs its decode
    rows through the W8A8 reference, which quantizes the activations too.)"""
    from raypaged.kernels import gemv_fp8
    from tests.model.test_fp8_checkpoints import PROMPTS, _load, _run
    from tests.support.checkpoints import checkpoint_dir

    model = _load(checkpoint_dir("llama"), quantization="fp8")
    calls: dict[str, int] = {"rope": 0, "silu": 0}
    for name, fused in (("rope", gemv_fp8.gemv_w8a16_rope), ("silu", gemv_fp8.gemv_w8a16_silu_mul)):
        def counted(*args, _fused=fused, _name=name, **kwargs):
            calls[_name] += 1
            return _fused(*args, **kwargs)
        monkeypatch.setattr(gemv_fp8, fused.__name__, counted)
    ops.set_backend("triton")
    try:
        gemv_config.set_epilogues(False)
        separate_tokens, separate_logits = _run(model)
        assert calls == {"rope": 0, "silu": 0}
        gemv_config.set_epilogues(True)
        tokens, logits = _run(model)
    finally:
        gemv_config.set_epilogues(True)
        ops.set_backend("auto")
    assert calls["rope"] > 0 and calls["silu"] > 0
    assert tokens == separate_tokens
    for req in PROMPTS:
        torch.testing.assert_close(logits[req], separate_logits[req], rtol=1e-4, atol=1e-4)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("rows", [1, 8, 16])
def test_gpu_fp8_epilogues_8b_shapes(rows):
    """The 8B's qkv (32 q and 8 kv heads of 128) and gate/up (14336) with e4m3 weights and bf16
    rows, at the configs the engine launches them with."""
    def config(out_features: int, group: int, name: str) -> dict:
        x = torch.zeros(rows, 4096, dtype=torch.bfloat16, device="cuda")
        weight = torch.zeros(out_features, 4096, device="cuda").to(torch.float8_e4m3fn)
        # where the table chose the one-row kernel the engine does not fuse; the kernel must
        # still be right
        return w8a16_epilogue_config(x, weight, group, name) or default_config(out_features, 4096, 1, rows=rows)

    check_rope(rows, 32, 8, 128, torch.bfloat16, False, config(6144, 64, "rope"), "cuda", 4096)
    check_rope(rows, 32, 8, 128, torch.bfloat16, True, dict(config(6144, 64, "rope"), split_k=2), "cuda", 4096)
    check_silu(rows, 14336, torch.bfloat16, False, config(28672, 14336, "silu"), "cuda", 4096)
