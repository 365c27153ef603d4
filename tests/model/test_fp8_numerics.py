"""FP8 (e4m3) arithmetic: saturation, per-channel / per-token scales, and Fp8Linear's product
(the CPU reference here; the `_scaled_mm` path against it under @pytest.mark.gpu)."""

from __future__ import annotations

import pytest
import torch

from raypaged.model.quantization.fp8 import Fp8Linear, Fp8UnsupportedError, check_device
from raypaged.model.quantization.numerics import (
    FP8_DTYPE,
    FP8_MAX,
    dequantize,
    quantize_activation,
    quantize_weight,
    to_fp8,
    weight_only_matmul_reference,
)

# e4m3 keeps 3 mantissa bits: a normal value rounds to within half a step, 2^-4 of itself.
E4M3_REL = 2.0**-4


def _fp8_layer(weight: torch.Tensor, activation: str = "token") -> tuple[Fp8Linear, torch.Tensor]:
    wq, scale = quantize_weight(weight)
    method = Fp8Linear(weight.shape[0], activation)
    method.weight_scale.copy_(scale)
    return method, wq


def test_values_beyond_the_range_saturate_never_inf_or_nan():
    x = torch.tensor([[0.0, 1.0, -1.0, 500.0, -1e6, float("inf"), -float("inf"), 447.0]])
    q = to_fp8(x, torch.tensor(1.0))
    assert q.dtype == FP8_DTYPE
    back = q.float()
    assert torch.isfinite(back).all()
    assert back[0, 3] == FP8_MAX and back[0, 4] == -FP8_MAX
    assert back[0, 5] == FP8_MAX and back[0, 6] == -FP8_MAX


def test_static_scale_too_small_saturates_instead_of_overflowing():
    x = torch.randn(4, 32) * 100
    q, scale = quantize_activation(x, static_scale=torch.tensor([0.01]))
    assert torch.isfinite(q.float()).all() and q.float().abs().max() == FP8_MAX
    assert torch.equal(scale, torch.full((4, 1), 0.01))


@pytest.mark.parametrize("magnitude", [1e-3, 1.0, 1e3])
def test_per_channel_weight_quantization_round_trips_within_e4m3_precision(magnitude):
    g = torch.Generator().manual_seed(0)
    w = torch.randn(48, 64, generator=g) * magnitude * torch.rand(48, 1, generator=g)
    wq, scale = quantize_weight(w)
    assert scale.shape == (48,) and scale.dtype == torch.float32
    # Each row's largest |w| lands on e4m3's largest value.
    assert torch.equal(wq.float().abs().amax(dim=1), torch.full((48,), FP8_MAX))
    back = dequantize(wq, scale[:, None])
    # Relative precision for values in e4m3's normal range; subnormals (|q| < 2^-6) within a step.
    normal = wq.float().abs() >= 2.0**-6
    rel = ((back - w).abs() / w.abs())[normal]
    assert rel.max() <= E4M3_REL
    assert ((back - w).abs()[~normal] <= 2.0**-9 * scale[:, None].expand_as(w)[~normal]).all()


def test_per_token_scales_are_per_row_and_a_zero_row_stays_zero():
    x = torch.randn(3, 16)
    x[1] *= 1000
    x[2] = 0
    q, scale = quantize_activation(x)
    assert scale.shape == (3, 1)
    torch.testing.assert_close(scale[:2, 0], x[:2].abs().amax(dim=1) / FP8_MAX)
    assert torch.equal(q.float()[2], torch.zeros(16)) and torch.isfinite(scale).all()
    # Per tensor: one scale for every row.
    _, tensor_scale = quantize_activation(x, per_token=False)
    assert torch.equal(tensor_scale, torch.full((3, 1), float(x.abs().max() / FP8_MAX)))


@pytest.mark.parametrize("activation", ["token", "tensor", "static"])
def test_fp8_linear_reference_is_close_to_the_float_product(activation):
    g = torch.Generator().manual_seed(1)
    w, x, b = torch.randn(96, 128, generator=g), torch.randn(7, 128, generator=g), torch.randn(96, generator=g)
    method, wq = _fp8_layer(w, activation)
    if activation == "static":
        assert method.input_scale is not None
        method.input_scale.fill_(float(x.abs().max()) / FP8_MAX)
    out = method.matmul(x, wq, b)
    ref = x @ w.t() + b
    assert out.shape == ref.shape and out.dtype == x.dtype
    # Both operands carry up to 2^-4 relative error; over 128 terms of random sign the product's
    # error is a few percent of its norm.
    rel = (out - ref).norm() / ref.norm()
    assert 1e-3 < rel < 0.05


def test_fp8_linear_reference_computes_the_dequantized_product_exactly():
    """The reference is (xq·wqᵀ)·sx·sw: the same value as dequantizing both and multiplying in
    float64, up to fp32 rounding."""
    g = torch.Generator().manual_seed(2)
    w, x = torch.randn(32, 64, generator=g), torch.randn(5, 64, generator=g)
    method, wq = _fp8_layer(w)
    xq, sx = method.quantize_input(x)
    expected = (dequantize(xq, sx).double() @ dequantize(wq, method.weight_scale[:, None]).double().t())
    torch.testing.assert_close(method.matmul(x, wq, None).double(), expected, rtol=1e-5, atol=1e-6)


def test_fp8_linear_keeps_the_model_dtype_and_leading_dims():
    w = torch.randn(16, 32)
    method, wq = _fp8_layer(w)
    x = torch.randn(2, 3, 32, dtype=torch.bfloat16)
    out = method.matmul(x, wq, None)
    assert out.shape == (2, 3, 16) and out.dtype == torch.bfloat16
    with pytest.raises(TypeError, match="float8"):
        method.matmul(x, w, None)


def test_gpu_without_fp8_tensor_cores_is_refused(monkeypatch):
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (8, 0))
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "NVIDIA A100")
    with pytest.raises(Fp8UnsupportedError, match=r"compute capability >= 8.9.*A100 has 8.0"):
        check_device(torch.device("cuda", 0))
    check_device(torch.device("cpu"))  # the reference runs anywhere


@pytest.mark.gpu
@pytest.mark.parametrize("rows", [1, 7, 16, 64, 300])
@pytest.mark.parametrize("activation", ["token", "static"])
def test_scaled_mm_matches_the_reference(rows, activation):
    """The GPU's FP8 product against the CPU reference of the arithmetic it runs: a decode
    step's few rows take the weight-only skinny GEMM (the rows unquantized), more rows cuBLASLt's
    W8A8 GEMM; only the accumulation order and the bf16 output rounding differ."""
    from raypaged.kernels.gemv_fp8 import w8a16_config

    g = torch.Generator().manual_seed(rows)
    w = torch.randn(384, 512, generator=g)
    x = torch.randn(rows, 512, generator=g).to(torch.bfloat16)
    b = torch.randn(384, generator=g).to(torch.bfloat16)
    method, wq = _fp8_layer(w, activation)
    if method.input_scale is not None:
        method.input_scale.fill_(float(x.float().abs().max()) / FP8_MAX)
    if w8a16_config(x.cuda(), wq.cuda()) is not None:
        ref = weight_only_matmul_reference(x, wq, method.weight_scale) + b.float()
    else:
        ref = method.matmul(x, wq, b).float()
    method = method.cuda()
    out = method.matmul(x.cuda(), wq.cuda(), b.cuda())
    assert out.dtype == torch.bfloat16
    torch.testing.assert_close(out.float().cpu(), ref, rtol=2e-2, atol=2e-2 * float(ref.abs().mean()))


@pytest.mark.parametrize("rows, overrides", [
    (1, {}), (5, {"split_k": 2, "block_k": 32}), (16, {"block_n": 32}),
    # The one-row kernel: tiles that divide the shape, and tiles that overhang it in N and K.
    (1, {"kernel": "row", "block_n": 16, "block_k": 32}), (1, {"kernel": "row", "block_n": 32, "block_k": 64})])
def test_skinny_fp8_gemm_computes_the_weight_only_product(rows, overrides):
    """kernels/gemv_fp8.py (interpreter here; the GPU suite runs it too) against the reference:
    the rows unquantized, the e4m3 weight widened, fp32 sums scaled per feature, bias added."""
    from raypaged.kernels.gemv_config import default_config
    from raypaged.kernels.gemv_fp8 import gemv_w8a16

    g = torch.Generator().manual_seed(rows)
    w, x, b = torch.randn(80, 96, generator=g), torch.randn(rows, 96, generator=g), torch.randn(80, generator=g)
    method, wq = _fp8_layer(w)
    config = {**default_config(80, 96, element_size=1, rows=rows), **overrides}
    out = gemv_w8a16(x, wq, method.weight_scale, b, config)
    expected = weight_only_matmul_reference(x, wq, method.weight_scale) + b
    torch.testing.assert_close(out, expected, rtol=1e-5, atol=1e-5)
    # Not the W8A8 product: the rows were not quantized.
    assert not torch.allclose(out, method.matmul(x, wq, b), rtol=1e-5, atol=1e-5)


def test_fp8_linear_takes_the_skinny_gemm_on_the_triton_backend(monkeypatch):
    from raypaged.kernels import gemv_fp8, ops

    w, x = torch.randn(64, 64), torch.randn(3, 64)
    method, wq = _fp8_layer(w)
    reference = weight_only_matmul_reference(x, wq, method.weight_scale)
    calls = []
    real = gemv_fp8.gemv_w8a16
    monkeypatch.setattr(gemv_fp8, "gemv_w8a16", lambda *a, **k: calls.append(1) or real(*a, **k))
    ops.set_backend("triton")
    try:
        out = method.matmul(x, wq, None)
    finally:
        ops.set_backend("auto")
    assert calls and torch.allclose(out, reference, rtol=1e-5, atol=1e-5)


@pytest.mark.gpu
@pytest.mark.parametrize("rows", [1, 8, 16])
def test_skinny_fp8_gemm_on_the_gpu_matches_the_reference(rows):
    from raypaged.kernels.gemv_fp8 import gemv_w8a16, w8a16_config

    g = torch.Generator().manual_seed(rows)
    w, x = torch.randn(4096, 4096, generator=g), torch.randn(rows, 4096, generator=g)
    method, wq = _fp8_layer(w)
    x16 = x.to(torch.bfloat16)
    ref = weight_only_matmul_reference(x16, wq, method.weight_scale)  # the bf16 rows, exactly
    x_cuda, wq_cuda = x16.cuda(), wq.cuda()
    config = w8a16_config(x_cuda, wq_cuda)
    assert config is not None  # up to 16 rows take the kernel by default
    configs = [config] + ([{"kernel": "row", "block_n": 8, "block_k": 512, "num_warps": 4, "num_stages": 3}]
                          if rows == 1 else [])
    for config in configs:
        out = gemv_w8a16(x_cuda, wq_cuda, method.weight_scale.cuda(), None, config)
        # fp32 sums of exact products: only the bf16 output's rounding (and the summation order).
        torch.testing.assert_close(out.float().cpu(), ref, rtol=1e-2, atol=1e-2 * float(ref.abs().mean()))


@pytest.mark.gpu
def test_fp8_model_on_the_gpu_loses_no_more_than_the_fp8_arithmetic():
    """The whole decoder in bf16 on the GPU (_scaled_mm for prefill, the skinny FP8 GEMM for
    decode rows) against the fp32 CPU model without quantization: no farther than the fp32 CPU
    reference of the same FP8 weights is (FP8's own error on this random model, ~10% of the
    logits' norm), plus what bf16 alone costs. The GPU cannot match the CPU reference closely:
    row-scaled _scaled_mm writes bf16, and each rounding moves some activations across an e4m3
    step in the next layer. A wrong or missing scale lands near 100%."""
    from raypaged.model.loader import load_model
    from tests.support.checkpoints import checkpoint_dir
    from tests.support.model_harness import PagedHarness, run_mixed_schedule

    prompts = {"a": list(range(3, 20)), "b": list(range(40, 45))}

    def prompt_logits(device, dtype, quantization):
        model = load_model(checkpoint_dir("llama"), dtype=dtype, device=device,
                           quantization=quantization, progress=False)
        if quantization:
            assert model.model.layers[0].mlp.down_proj.weight.dtype == FP8_DTYPE
        harness = PagedHarness(model, model.config, block_size=16, num_blocks=32, seed=3, dtype=dtype, device=device)
        run_mixed_schedule(harness, prompts, 4)
        # The prompt's positions only: the generated tokens may differ, and with them the inputs.
        return {r: harness.logits_of(r)[:len(p)].float().cpu() for r, p in prompts.items()}

    def rel(x, y):
        return max(float((x[r] - y[r]).norm() / y[r].norm()) for r in prompts)

    exact = prompt_logits("cpu", torch.float32, None)
    fp8_reference = rel(prompt_logits("cpu", torch.float32, "fp8"), exact)
    bf16_alone = rel(prompt_logits("cuda", torch.bfloat16, None), exact)
    fp8_gpu = rel(prompt_logits("cuda", torch.bfloat16, "fp8"), exact)
    assert fp8_gpu <= 1.25 * fp8_reference + bf16_alone, (fp8_gpu, fp8_reference, bf16_alone)
