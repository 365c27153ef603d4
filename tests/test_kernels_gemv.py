"""The skinny GEMM (kernels/gemv.py) against the float64 product.

On CPU it runs under TRITON_INTERPRET=1 (tests/conftest.py) at small shapes; the `gpu` test
repeats it in bf16 at the 8B's shapes with the real compiler (scripts/gpu_kernels.sh). fp32 must
stay within 1e-5 relative of the exact product (IEEE products, fp32 sums); fp16/bf16 within
twice the rounding error F.linear itself makes in that dtype.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from raypaged.kernels.gemv import MAX_ROWS, default_config, gemv_triton, supports


def check(rows: int, out_features: int, in_features: int, dtype: torch.dtype, device: str = "cpu",
          bias: bool = False, **config) -> None:
    gen = torch.Generator().manual_seed(rows * 1000 + out_features)
    x = torch.randn(rows, in_features, generator=gen).to(dtype).to(device)
    weight = (torch.randn(out_features, in_features, generator=gen) * 0.05).to(dtype).to(device)
    b = torch.randn(out_features, generator=gen).to(dtype).to(device) if bias else None
    out = gemv_triton(x, weight, b, **config)
    assert out.shape == (rows, out_features) and out.dtype == dtype
    exact = F.linear(x.double(), weight.double(), None if b is None else b.double())
    error = (out.double() - exact).abs().max().item()
    if dtype == torch.float32:
        assert error <= 1e-5 * exact.abs().max().item(), error
    else:
        own = (F.linear(x.float(), weight.float(), None if b is None else b.float())
               .to(dtype).double() - exact).abs().max().item()
        assert error <= 2 * own + 1e-3, (error, own)


@pytest.mark.parametrize("rows", [1, 3, MAX_ROWS])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_matches_the_product(rows, dtype):
    # 96 x 320: neither a multiple of block_n = 64 nor of block_k = 128 (the masked path)
    check(rows, 96, 320, dtype, block_n=64, block_k=128)


@pytest.mark.parametrize("bias", [False, True])
def test_even_shapes_and_bias(bias):
    check(2, 128, 256, torch.float32, bias=bias, block_n=32, block_k=128)


def test_one_row_odd_shape_with_bias():
    check(1, 100, 300, torch.float32, bias=True, block_n=16, block_k=128)


def test_default_config():
    check(4, 64, 512, torch.float32)
    # The pipeline fits the shared memory it is given (an H200's, an A100's).
    for shared_memory in (227 * 1024, 163 * 1024):
        for element_size in (2, 4):
            config = default_config(4096, 14336, element_size, shared_memory)
            stage = (config["block_n"] + 16) * config["block_k"] * element_size
            assert config["num_stages"] * stage <= shared_memory - 8 * 1024


def test_refuses_what_it_does_not_take():
    weight = torch.zeros(32, 64)
    assert supports(torch.zeros(MAX_ROWS, 64), weight)
    assert not supports(torch.zeros(MAX_ROWS + 1, 64), weight)
    assert not supports(torch.zeros(64, 2).t(), weight.t().contiguous().t())  # K not contiguous
    assert not supports(torch.zeros(1, 64, dtype=torch.float16), weight)
    with pytest.raises(ValueError, match="gemv_triton takes"):
        gemv_triton(torch.zeros(MAX_ROWS + 1, 64), weight)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("rows", [1, 8, MAX_ROWS])
@pytest.mark.parametrize("shape", [(6144, 4096), (4096, 14336), (128256, 4096)])
def test_gpu_bf16_8b_shapes(rows, shape):
    check(rows, *shape, torch.bfloat16, device="cuda")
    check(rows, *shape, torch.bfloat16, device="cuda", bias=True)
