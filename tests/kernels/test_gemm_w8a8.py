"""kernels/gemm_w8a8.py (interpreter here; the GPU suite runs it too) against
numerics.grouped_w8a8_reference: the rows quantized per (row, block_k group) inside the GEMM,
the e4m3 weight as it is, fp32 sums scaled per group, then per output feature, bias added. Odd
shapes (every tile masked somewhere), zero rows, values far beyond e4m3's range, split-K on and
off; and which products take it (the device's table only)."""

from __future__ import annotations

import pytest
import torch

from raypaged.kernels import gemm_w8a8, gemv
from raypaged.kernels.gemm_w8a8 import TABLE_DTYPE, default_config, table_rows, w8a8_config
from raypaged.kernels.gemm_w8a8 import gemm_w8a8 as fused
from raypaged.model.quantization.numerics import (
    FP8_MAX,
    grouped_w8a8_reference,
    quantize_activation,
    quantize_groups,
    quantize_weight,
    scaled_matmul_reference,
    weight_only_matmul_reference,
)

SMALL = dict(block_m=16, block_n=32, block_k=32, num_warps=4, num_stages=2, split_k=1)


def _device() -> str:
    return "cuda" if torch.cuda.is_available() else "cpu"


def _operands(rows: int, out_features: int, in_features: int, dtype: torch.dtype, bias: bool, seed: int = 0):
    gen = torch.Generator().manual_seed(seed)
    # Rows of very different magnitudes: a per-row scale that went to the wrong row shows.
    x = (torch.randn(rows, in_features, generator=gen) * torch.logspace(-2, 2, rows)[:, None]).to(dtype)
    wq, scale = quantize_weight(torch.randn(out_features, in_features, generator=gen) * 0.1)
    b = torch.randn(out_features, generator=gen).to(dtype) if bias else None
    return x, wq, scale, b


def _reference(x, wq, scale, b, group) -> torch.Tensor:
    out = grouped_w8a8_reference(x, wq, scale, group)
    return out + b.float() if b is not None else out


def _assert_matches_reference(out: torch.Tensor, expected: torch.Tensor) -> None:
    """fp32 output: only the order of the fp32 sums differs (the same e4m3 values enter them, or
    one value an e4m3 step off would show at ~1e-2 of a row). Else: the output's rounding, an
    ulp of the row's largest value (the interpreter's conversion to bf16 does not round to
    nearest: up to an ulp off torch's)."""
    assert out.dtype in (torch.float32, torch.bfloat16, torch.float16)
    assert torch.isfinite(out).all()
    size = expected.abs().amax(dim=1, keepdim=True).clamp_min(1e-30)  # per row: rows differ by 10^4
    if out.dtype == torch.float32:
        assert ((out - expected).abs() <= 2e-6 * size).all(), ((out - expected).abs() / size).max()
    else:
        step = 2.0**-7 if out.dtype == torch.bfloat16 else 2.0**-10
        assert ((out.float() - expected).abs() <= step * size).all()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("rows, out_features, in_features, overrides, bias", [
    (1, 64, 64, {}, False),
    (5, 80, 96, {}, True),  # N, K not multiples of the blocks
    (17, 50, 70, {"split_k": 2}, True),  # a second row tile of one row, K uneven within a split
    (33, 64, 100, {"split_k": 4, "block_m": 32}, False),  # a trailing split with no K at all
    (80, 96, 64, {"block_m": 64, "block_n": 64, "block_k": 64}, True),
])
def test_the_kernel_computes_the_grouped_reference(dtype, rows, out_features, in_features, overrides, bias):
    x, wq, scale, b = _operands(rows, out_features, in_features, dtype, bias, seed=rows)
    config = {**SMALL, **overrides}
    out = fused(x.to(_device()), wq.to(_device()), scale.to(_device()),
                b.to(_device()) if b is not None else None, config)
    assert out.dtype == dtype and out.shape == (rows, out_features)
    _assert_matches_reference(out.cpu(), _reference(x, wq, scale, b, config["block_k"]))


def test_split_k_changes_only_the_order_of_the_sums():
    x, wq, scale, _ = _operands(9, 64, 256, torch.float32, False, seed=4)
    outs = [fused(x, wq, scale, None, dict(SMALL, split_k=split)) for split in (1, 2, 3, 4, 8)]
    for out in outs[1:]:
        _assert_matches_reference(out, outs[0])
    assert not gemv._arrivals(x.device).any()  # the last split of each tile reset its counter
    # Groups of 32 whatever the splits: not the per-64 groups of another block_k.
    other = grouped_w8a8_reference(x, wq, scale, 64)
    assert not torch.allclose(outs[0], other, rtol=1e-5, atol=1e-5)


def test_zero_rows_give_the_bias_and_huge_values_saturate_to_finite_sums():
    x, wq, scale, b = _operands(6, 48, 96, torch.bfloat16, True, seed=7)
    x[1] = 0
    x[2, :40] = 0  # zero groups inside a row
    x[3] = torch.linspace(-1e6, 1e6, 96).to(torch.bfloat16)  # far beyond 448, every group
    x[4, ::7] = FP8_MAX  # at the top of e4m3's range exactly
    x[5, 5] = -1e30  # one group's scale ~ 2e27: its sums stay within fp32
    out = fused(x, wq, scale, b, SMALL)
    assert torch.isfinite(out).all()
    assert torch.equal(out[1], b)
    _assert_matches_reference(out, _reference(x, wq, scale, b, SMALL["block_k"]))
    q, group_scale = quantize_groups(x, SMALL["block_k"])
    assert torch.isfinite(q.float()).all() and q.float().abs().max() == FP8_MAX
    assert (group_scale[1] > 0).all()  # the zero row's guard: no division by zero


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_the_product_is_within_e4m3_precision_of_the_exact_one(dtype):
    """Against the rows unquantized (times the same e4m3 weight): the rows' rounding to e4m3
    (3 mantissa bits, 2^-4 relative at most) is the only error; over 256 products of random
    signs it stays a few percent of a row's largest output."""
    x, wq, scale, _ = _operands(24, 64, 256, dtype, False, seed=11)
    out = fused(x, wq, scale, None, dict(SMALL, block_k=64)).float()
    exact = weight_only_matmul_reference(x, wq, scale)
    size = exact.abs().amax(dim=1, keepdim=True)
    assert ((out - exact).abs() <= 2.0**-4 * size).all()
    assert ((out - exact).abs() > 1e-6 * size).any()  # the rows were quantized, not passed through


def test_groups_are_closer_than_per_token_scales_where_a_row_has_an_outlier():
    """One large value in a row's first group: per-token scaling sends the rest of the row into
    e4m3's subnormals (a few steps of 2^-9 of the outlier's scale), per-group scaling only the
    rest of that group."""
    x, wq, scale, _ = _operands(8, 64, 256, torch.float32, False, seed=3)
    x = torch.randn(8, 256, generator=torch.Generator().manual_seed(5))
    x[:, 3] = 1e5
    exact = weight_only_matmul_reference(x, wq, scale)
    ours = (fused(x, wq, scale, None, dict(SMALL, block_k=32)) - exact).norm()
    per_token = (scaled_matmul_reference(*quantize_activation(x), wq, scale) - exact).norm()
    assert ours < 0.5 * per_token, (ours, per_token)


def test_a_strided_view_of_rows():
    x, wq, scale, _ = _operands(10, 32, 64, torch.float32, False)
    view = x[::2]
    _assert_matches_reference(fused(view, wq, scale, None, SMALL), _reference(view, wq, scale, None, 32))


def test_operands_and_configs_it_refuses():
    x, wq, scale, _ = _operands(4, 32, 64, torch.float32, False)
    with pytest.raises(ValueError, match="e4m3 weight"):
        fused(x, wq.float(), scale, None, SMALL)
    with pytest.raises(ValueError, match="weight scales"):
        fused(x, wq, scale[:-1], None, SMALL)
    with pytest.raises(TypeError, match="unknown config fields"):
        fused(x, wq, scale, None, dict(SMALL, block_q=4))


def test_the_default_config_computes_the_product():
    for rows in (2, 16, 100):
        x, wq, scale, b = _operands(rows, 160, 300, torch.bfloat16, True, seed=rows)
        config = default_config(rows)
        assert config["block_m"] == min(64, table_rows(rows))
        _assert_matches_reference(fused(x, wq, scale, b, config), _reference(x, wq, scale, b, config["block_k"]))


# ---- which products take it


def test_only_the_tables_entries_choose_the_kernel(monkeypatch):
    wq, _ = quantize_weight(torch.randn(64, 32))
    tuned = dict(SMALL, block_m=32)
    entries = {16: {"backend": "triton", "config": tuned}, 64: {"backend": "engine", "config": SMALL}}
    asked = []

    def entry(x, weight):
        asked.append(table_rows(x.shape[0]))
        return entries.get(table_rows(x.shape[0]))

    monkeypatch.setattr(gemm_w8a8, "tuned_entry", entry)
    assert w8a8_config(torch.zeros(2, 32, dtype=torch.bfloat16), wq) == tuned
    assert w8a8_config(torch.zeros(16, 32, dtype=torch.float16), wq) == tuned
    assert w8a8_config(torch.zeros(1, 32, dtype=torch.bfloat16), wq) is None  # the one-row kernel's
    assert w8a8_config(torch.zeros(16, 32, dtype=torch.float32), wq) is None  # not what was swept
    assert w8a8_config(torch.zeros(40, 32, dtype=torch.bfloat16), wq) is None  # the table kept the engine's
    assert w8a8_config(torch.zeros(100, 32, dtype=torch.bfloat16), wq) is None  # no entry
    assert w8a8_config(torch.zeros(257, 32, dtype=torch.bfloat16), wq) is None  # past MAX_ROWS
    assert 512 not in asked and 1 not in asked
    assert w8a8_config(torch.zeros(16, 32, dtype=torch.bfloat16), wq.float()) is None  # not e4m3
    monkeypatch.undo()
    assert w8a8_config(torch.zeros(16, 32, dtype=torch.bfloat16), wq) is None  # CPU: no table


def test_table_key_is_its_own():
    assert TABLE_DTYPE == "float8_e4m3fn_w8a8"  # the weight-only kernel's entries are "float8_e4m3fn"
    assert [table_rows(r) for r in (2, 16, 17, 64, 65, 256)] == [16, 16, 32, 64, 128, 256]


@pytest.mark.gpu
@pytest.mark.parametrize("rows", [2, 16, 64, 200])
@pytest.mark.parametrize("split_k", [1, 4])
def test_on_the_gpu_at_real_shapes_and_in_a_cuda_graph(rows, split_k):
    """bf16 rows at the 8B's qkv shape: the same e4m3 values as the reference (the rounding is
    bit arithmetic) and fp32 sums of exact products; only the tensor cores' summation order and
    the bf16 output differ. Replayed in a CUDA graph (no host synchronization), the same bits."""
    gen = torch.Generator().manual_seed(rows)
    wq, scale = quantize_weight(torch.randn(6144, 4096, generator=gen) * 0.02)
    x = torch.randn(rows, 4096, generator=gen).to(torch.bfloat16)
    config = dict(default_config(rows), split_k=split_k)
    expected = grouped_w8a8_reference(x, wq, scale, config["block_k"])
    x, wq, scale = x.cuda(), wq.cuda(), scale.cuda()
    out = fused(x, wq, scale, None, config)
    torch.testing.assert_close(out.float().cpu(), expected, rtol=1e-2, atol=1e-2 * float(expected.abs().mean()))
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        replayed = fused(x, wq, scale, None, config)
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(replayed, out)
