"""Fp8Linear and the fused W8A8 kernel (kernels/gemm_w8a8.py): where the device's table has an
entry for the product, the dynamic activation modes run it (its rope / SwiGLU seams then decline,
so the layer runs the separate kernels after it); with no entry, a static input scale or the torch
backend, the paths are unchanged. Interpreter here (the table is faked); the kernel on the GPU:
tests/kernels/test_gemm_w8a8.py."""

from __future__ import annotations

import pytest
import torch

from raypaged.kernels import gemm_w8a8, ops
from raypaged.model.quantization.fp8 import Fp8Linear
from raypaged.model.quantization.numerics import grouped_w8a8_reference, quantize_weight

CONFIG = dict(block_m=16, block_n=32, block_k=32, num_warps=4, num_stages=2, split_k=1)


def _layer(out_features: int, in_features: int, activation: str = "token", seed: int = 0):
    gen = torch.Generator().manual_seed(seed)
    wq, scale = quantize_weight(torch.randn(out_features, in_features, generator=gen) * 0.1)
    method = Fp8Linear(out_features, activation)
    method.weight_scale.copy_(scale)
    x = torch.randn(6, in_features, generator=gen).to(torch.bfloat16)
    return method, wq, x


@pytest.fixture
def table(monkeypatch):
    """A device table with one entry choosing the fused kernel, at 16 rows, and the Triton backend."""
    entries: dict[int, dict] = {16: {"backend": "triton", "config": CONFIG}}
    monkeypatch.setattr(gemm_w8a8, "tuned_entry", lambda x, w: entries.get(gemm_w8a8.table_rows(x.shape[0])))
    calls: list[dict] = []
    real = gemm_w8a8.gemm_w8a8
    monkeypatch.setattr(gemm_w8a8, "gemm_w8a8", lambda *a, **k: calls.append(a[4]) or real(*a, **k))
    ops.set_backend("triton")
    yield entries, calls
    ops.set_backend("auto")


@pytest.mark.parametrize("activation", ["token", "tensor"])
def test_a_table_entry_sends_the_dynamic_modes_to_the_fused_kernel(table, activation):
    _, calls = table
    method, wq, x = _layer(64, 96, activation)
    bias = torch.randn(64).to(torch.bfloat16)
    out = method.matmul(x.view(2, 3, 96), wq, bias)
    assert calls == [CONFIG] and out.shape == (2, 3, 64) and out.dtype == torch.bfloat16
    expected = grouped_w8a8_reference(x, wq, method.weight_scale, CONFIG["block_k"]) + bias.float()
    torch.testing.assert_close(out.view(6, 64).float(), expected, rtol=2.0**-7,
                               atol=2.0**-7 * float(expected.abs().max()))


def test_no_entry_static_scales_and_the_torch_backend_keep_their_paths(table):
    entries, calls = table
    method, wq, x = _layer(64, 96)
    method.matmul(x[:1], wq, None)  # one row: no entry for it (the one-row kernel's)
    static, _, _ = _layer(64, 96, "static")
    static.input_scale.fill_(0.01)
    static.matmul(x, wq, None)
    ops.set_backend("torch")
    method.matmul(x, wq, None)
    ops.set_backend("triton")
    entries[16] = {"backend": "engine", "config": CONFIG}  # the sweep kept the engine's path
    method.matmul(x, wq, None)
    assert calls == []


def test_where_the_fused_kernel_takes_the_product_the_epilogue_seams_decline(table):
    entries, calls = table
    method, wq, x = _layer(64, 96)
    cos = sin = torch.zeros(6, 16)
    assert method.matmul_silu_mul(x, wq, None) is None
    assert method.matmul_rope(x, wq, None, cos, sin, 32, 64) is None
    assert calls == []
    entries.clear()  # then the weight-only kernel's epilogues, as before
    assert method.matmul_silu_mul(x, wq, None) is not None

