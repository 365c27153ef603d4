"""kernels/fp8_quant.py against its torch reference: the same e4m3 bits and scales, per token
and with a static scale, saturation included (interpreter here; the GPU suite runs it too)."""

from __future__ import annotations

import pytest
import torch

from raypaged.kernels.fp8_quant import FP8_MAX, quantize_fp8_triton, quantize_rows_ref


def _device() -> str:
    return "cuda" if torch.cuda.is_available() else "cpu"


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rows, cols", [(1, 64), (5, 100), (3, 5000)])
def test_per_token_quantization_is_the_references_bit_for_bit(dtype, rows, cols):
    g = torch.Generator().manual_seed(rows * cols)
    x = (torch.randn(rows, cols, generator=g) * torch.logspace(-3, 3, rows)[:, None]).to(dtype)
    if rows > 1:
        x[1] = 0  # an all-zero row: the smallest scale, zeros
    x = x.to(_device())
    q, scale = quantize_fp8_triton(x)
    q_ref, scale_ref = quantize_rows_ref(x)
    assert torch.equal(scale, scale_ref)
    assert torch.equal(q.view(torch.uint8), q_ref.view(torch.uint8))


def test_static_scale_saturates_like_the_reference():
    x = torch.randn(4, 48, device=_device()) * 50
    x[0, 0], x[1, 1] = float("inf"), -1e30
    static = torch.tensor([0.01], device=_device())
    q, scale = quantize_fp8_triton(x, static)
    q_ref, scale_ref = quantize_rows_ref(x, static)
    assert torch.equal(scale, scale_ref) and torch.equal(scale, torch.full_like(scale, 0.01))
    assert torch.equal(q.view(torch.uint8), q_ref.view(torch.uint8))
    values = q.float()
    assert torch.isfinite(values).all() and values[0, 0] == FP8_MAX and values[1, 1] == -FP8_MAX


def test_a_strided_view_of_rows_and_no_rows():
    x = torch.randn(6, 64, device=_device())[::2]
    q, scale = quantize_fp8_triton(x)
    q_ref, scale_ref = quantize_rows_ref(x)
    assert torch.equal(q.view(torch.uint8), q_ref.view(torch.uint8)) and torch.equal(scale, scale_ref)
    q, scale = quantize_fp8_triton(torch.empty(0, 64, device=_device()))
    assert q.shape == (0, 64) and scale.shape == (0, 1)


def test_every_binade_and_the_subnormals_round_to_nearest_even():
    """Values from 2^-12 (below e4m3's smallest subnormal, 2^-9) to 448 at scale 1, with
    every e4m3 value and every midpoint between neighbours (the ties) among them."""
    grid = torch.arange(0, 127, dtype=torch.uint8).view(torch.float8_e4m3fn).float()  # 0 .. 448
    mids = (grid[:-1] + grid[1:]) / 2
    g = torch.Generator().manual_seed(0)
    spread = torch.logspace(-12, 8.8, 4096, base=2.0) * (1 + 0.01 * torch.rand(4096, generator=g))
    values = torch.cat([grid, mids, spread.clamp(max=FP8_MAX)])
    x = torch.cat([values, -values])[None, :].to(_device())
    q, _ = quantize_fp8_triton(x, torch.tensor([1.0], device=_device()))
    q_ref, _ = quantize_rows_ref(x, torch.tensor([1.0], device=_device()))
    assert torch.equal(q.view(torch.uint8), q_ref.view(torch.uint8))


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_the_gpu_kernel_is_the_references_bit_for_bit(dtype):
    x = (torch.randn(64, 4096) * torch.logspace(-4, 3, 64)[:, None]).to(dtype).cuda()
    q, scale = quantize_fp8_triton(x)
    q_ref, scale_ref = quantize_rows_ref(x)
    assert torch.equal(scale, scale_ref) and torch.equal(q.view(torch.uint8), q_ref.view(torch.uint8))
