"""The skinny GEMM (raypaged/kernels/gemv.py) against the float64 product.

On CPU it runs under TRITON_INTERPRET=1 (tests/conftest.py) at small shapes; the `gpu` test
repeats it in bf16 at the 8B's shapes with the real compiler (scripts/gpu.sh tests). fp32 must
stay within 1e-5 relative of the exact product (IEEE products, fp32 sums); fp16/bf16 within
twice the rounding error F.linear itself makes in that dtype.
"""

from __future__ import annotations

import json

import pytest
import torch
import torch.nn.functional as F

from raypaged import envs
from raypaged.kernels import gemv, gemv_config, gemv_table
from raypaged.kernels.activation import silu_and_mul_triton
from raypaged.kernels.gemv import gemv_rope, gemv_silu_mul, gemv_triton
from raypaged.kernels.gemv_config import MAX_ROWS, default_config, epilogue_config, supports
from raypaged.kernels.rope import rope_in_place_triton, rope_tables_triton


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
            for rows in (1, 16, 64):
                config = default_config(4096, 14336, element_size, shared_memory, rows)
                stage = (config["block_n"] + gemv_config.padded_rows(rows)) * config["block_k"] * element_size
                assert config["num_stages"] * stage <= shared_memory - 8 * 1024


@pytest.mark.parametrize("rows,split_k", [(64, 3), (20, 2), (1, 4)])
def test_split_k(rows, split_k):
    # 320 = 5 tiles of 64 over 3 splits of 128 (the last one short); over 4 splits, of 64 each
    check(rows, 96, 320, torch.float32, block_n=32, block_k=64, split_k=split_k)
    check(rows, 96, 320, torch.bfloat16, bias=True, block_n=64, block_k=64, split_k=split_k)


def test_split_k_is_deterministic_and_leaves_the_counters_at_zero():
    gen = torch.Generator().manual_seed(3)
    x, weight = torch.randn(33, 256, generator=gen), torch.randn(64, 256, generator=gen)
    # 8 splits of 64 over 256: the last four are empty and add zeros
    first = gemv_triton(x, weight, block_n=32, block_k=32, split_k=8)
    assert torch.equal(first, gemv_triton(x, weight, block_n=32, block_k=32, split_k=8))
    assert not gemv._arrivals(x.device).any()


def test_launch_config_follows_the_tuned_table(monkeypatch):
    weight = torch.zeros(128, 64)
    entries = {}
    monkeypatch.setattr(gemv_config, "tuned_entry", lambda x, w: entries.get(gemv_config.padded_rows(x.shape[0])))
    assert gemv_config.launch_config(torch.zeros(gemv_config.DEFAULT_ROWS, 64), weight) == default_config(
        128, 64, 4, rows=gemv_config.DEFAULT_ROWS)
    assert gemv_config.launch_config(torch.zeros(gemv_config.DEFAULT_ROWS + 1, 64), weight) is None  # cuBLAS
    tuned = {"block_n": 32, "block_k": 32, "num_warps": 4, "num_stages": 2, "split_k": 2}
    entries[64] = {"backend": "triton", "config": tuned}
    entries[16] = {"backend": "cublas", "config": {}}
    assert gemv_config.launch_config(torch.zeros(40, 64), weight) == tuned
    assert gemv_config.launch_config(torch.zeros(4, 64), weight) is None
    assert gemv_config.launch_config(torch.zeros(MAX_ROWS + 1, 64), weight) is None


def test_table_records_and_looks_up(tmp_path):
    path = gemv_table.table_path("NVIDIA H200", tmp_path)
    assert path.name == "gemv_nvidia_h200.json"
    entry = {"dtype": "bfloat16", "out": 4096, "in": 14336, "rows": 64, "backend": "triton",
             "config": {"block_n": 128, "block_k": 128, "num_warps": 8, "num_stages": 4, "split_k": 4}}
    gemv_table.record(path, "NVIDIA H200", {"commit": "x"}, [entry])
    assert gemv_table.lookup("NVIDIA H200", "bfloat16", 4096, 14336, 64, tmp_path) == entry
    assert gemv_table.lookup("NVIDIA H200", "bfloat16", 4096, 14336, 32, tmp_path) is None
    assert gemv_table.lookup("NVIDIA A100", "bfloat16", 4096, 14336, 64, tmp_path) is None
    gemv_table.record(path, "NVIDIA H200", {"commit": "y"}, [dict(entry, backend="cublas")])
    assert gemv_table.lookup("NVIDIA H200", "bfloat16", 4096, 14336, 64, tmp_path)["backend"] == "cublas"
    with pytest.raises(ValueError, match="table of NVIDIA H200"):
        gemv_table.record(path, "NVIDIA A100", {}, [entry])


@pytest.mark.parametrize("path", sorted(gemv_table.CONFIG_DIR.glob("gemv_*.json")), ids=lambda p: p.name)
def test_committed_tables_configs_compute_the_product(path):
    # Each tuned config, on a small product of its own tile sizes (two tiles of outputs, two K
    # tiles per split) in the interpreter: a table can only choose configs that are correct.
    # FP8 entries (e4m3 weights, the weight-only kernels of gemv_fp8.py; rows 1 is the one-row
    # kernel's key) against the weight-only reference; fused W8A8 entries (gemm_w8a8.py) against
    # the grouped reference, whichever backend the sweep chose.
    from raypaged.kernels import gemm_w8a8
    from raypaged.kernels.gemv_fp8 import TABLE_DTYPE, gemv_w8a16
    from raypaged.model.quantization.numerics import (
        grouped_w8a8_reference,
        quantize_weight,
        weight_only_matmul_reference,
    )

    table = json.loads(path.read_text())
    for entry in table["entries"]:
        c = entry["config"]
        if entry["dtype"] == gemm_w8a8.TABLE_DTYPE:
            assert entry["backend"] in ("triton", "engine") and entry["rows"] in (16, 32, 64, 128, 256)
            rows, split = min(entry["rows"], 2 * c["block_m"] - 3), c["split_k"]
            gen = torch.Generator().manual_seed(rows)
            weight, scale = quantize_weight(torch.randn(2 * c["block_n"], 2 * c["block_k"] * split, generator=gen))
            x = torch.randn(rows, weight.shape[1], generator=gen)
            expected = grouped_w8a8_reference(x, weight, scale, c["block_k"])
            error = (gemm_w8a8.gemm_w8a8(x, weight, scale, None, c) - expected).abs().max().item()
            assert error <= 1e-5 * expected.abs().max().item(), (entry["linear"], entry["rows"], error)
            continue
        if entry["dtype"] == TABLE_DTYPE:
            assert entry["backend"] == "triton" and entry["rows"] in (1, 16, 32, 64)
            rows, split = min(entry["rows"], 5), c.get("split_k", 1)
            gen = torch.Generator().manual_seed(rows)
            weight, scale = quantize_weight(torch.randn(2 * c["block_n"], 2 * c["block_k"] * split, generator=gen))
            x = torch.randn(rows, weight.shape[1], generator=gen)
            exact = weight_only_matmul_reference(x.double(), weight, scale.double())
            error = (gemv_w8a16(x, weight, scale, None, c).double() - exact).abs().max().item()
            assert error <= 1e-5 * exact.abs().max().item(), (entry["linear"], entry["rows"], error)
            continue
        assert entry["backend"] in ("triton", "cublas") and entry["rows"] in (16, 32, 64)
        check(min(entry["rows"], 5), 2 * c["block_n"], 2 * c["block_k"] * c["split_k"], torch.float32,
              **c)


# ---- fused epilogues: the GEMM then the separate kernel, to the last bits


def _epilogue_inputs(rows, out_features, dtype, bias, seed=0, device="cpu", in_features=96):
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(rows, in_features, generator=gen).to(dtype).to(device)
    weight = (torch.randn(out_features, in_features, generator=gen) * 0.1).to(dtype).to(device)
    b = torch.randn(out_features, generator=gen).to(dtype).to(device) if bias else None
    return x, weight, b


def check_rope_epilogue(rows, q_heads, kv_heads, head_dim, dtype, bias, config, device="cpu",
                        in_features=96):
    x, weight, b = _epilogue_inputs(rows, (q_heads + 2 * kv_heads) * head_dim, dtype, bias,
                                    device=device, in_features=in_features)
    positions = torch.randint(0, 5000, (rows,), generator=torch.Generator().manual_seed(1)).to(device)
    inv_freq = (1.0 / 10000 ** (torch.arange(0, head_dim, 2).float() / head_dim)).to(device)
    expected = gemv_triton(x, weight, b, config=config)
    q, k, _ = expected.split([q_heads * head_dim, kv_heads * head_dim, kv_heads * head_dim], -1)
    cos, sin = rope_tables_triton(positions, inv_freq)
    rope_in_place_triton(q.view(rows, q_heads, head_dim), k.view(rows, kv_heads, head_dim), cos, sin)
    out = gemv_rope(x, weight, b, cos, sin, head_dim, (q_heads + kv_heads) * head_dim, config)
    _assert_same(out, expected)


def check_silu_epilogue(rows, intermediate, dtype, bias, config, device="cpu", in_features=96):
    x, weight, b = _epilogue_inputs(rows, 2 * intermediate, dtype, bias, seed=2, device=device,
                                    in_features=in_features)
    expected = silu_and_mul_triton(gemv_triton(x, weight, b, config=config))
    out = gemv_silu_mul(x, weight, b, config)
    assert out.shape == (rows, intermediate)
    _assert_same(out, expected)


def _assert_same(out: torch.Tensor, expected: torch.Tensor) -> None:
    """The fused kernel against the GEMM then the separate kernel: the same arithmetic, but not
    the same instruction order. A GPU compiler contracts multiply-adds (a·cos − b·sin) into FMAs
    as it sees fit in each kernel, and the interpreter's numpy picks its reduction and FMA paths
    by block shape, so fp32 values may differ in their last bits and a rounded bf16 output by
    one step where those bits decide it; a wrong pair, table or gather is off by far more."""
    if out.dtype == torch.float32:
        torch.testing.assert_close(out, expected, rtol=1.3e-6, atol=1e-5)
        return
    one_step = expected.float().abs() * 2.0**-7 + 1e-30
    assert ((out.float() - expected.float()).abs() <= one_step).all()
    assert (out != expected).float().mean().item() < 0.01


_SMALL = dict(block_n=32, block_k=32, num_warps=4, num_stages=2, split_k=1)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rows,block_n,split_k,bias", [(3, 32, 1, True), (17, 16, 3, False),
                                                        (MAX_ROWS, 32, 2, True)])
def test_rope_epilogue_is_the_gemm_then_rope(dtype, rows, block_n, split_k, bias):
    # head_dim 32: a block of 32 is one head, a block of 16 half of one (pairs 8 apart)
    config = dict(_SMALL, block_n=block_n, split_k=split_k)
    check_rope_epilogue(rows, 4, 2, 32, dtype, bias, config)
    check_rope_epilogue(rows, 3, 1, 16, dtype, bias, dict(config, block_n=16))  # MQA, one kv head


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rows,block_n,split_k,bias", [(5, 32, 1, True), (MAX_ROWS, 16, 2, False)])
def test_silu_epilogue_is_the_gemm_then_silu_and_mul(dtype, rows, block_n, split_k, bias):
    check_silu_epilogue(rows, 48, dtype, bias, dict(_SMALL, block_n=block_n, split_k=split_k))


def test_epilogue_config_pairs_features_or_declines(monkeypatch):
    weight = torch.zeros(256, 64)
    rows = gemv_config.EPILOGUE_MIN_ROWS
    monkeypatch.setattr(gemv_config, "tuned_entry", lambda x, w: None)
    assert epilogue_config(torch.zeros(rows, 64), weight, 64, "rope") is None  # not measured here
    # where the table chose cuBLAS for the plain product the fused one still takes its config
    tuned = {"block_n": 128, "block_k": 32, "num_warps": 4, "num_stages": 2, "split_k": 2}
    monkeypatch.setattr(gemv_config, "tuned_entry", lambda x, w: {"backend": "cublas", "config": tuned})
    assert gemv_config.launch_config(torch.zeros(rows, 64), weight) is None
    assert epilogue_config(torch.zeros(rows, 64), weight, 64, "silu") == tuned
    assert epilogue_config(torch.zeros(rows, 64), weight, 16, "rope") == dict(tuned, block_n=32)
    assert epilogue_config(torch.zeros(rows, 64), weight, 8, "rope") == dict(tuned, block_n=16)
    assert epilogue_config(torch.zeros(rows, 64), weight, 12, "rope") is None  # pairs of 4 < 16 / 2
    assert epilogue_config(torch.zeros(rows - 1, 64), weight, 64, "silu") is None  # too few rows
    assert epilogue_config(torch.zeros(MAX_ROWS + 1, 64), weight, 64, "silu") is None
    monkeypatch.setattr(envs, "RAYPAGED_GEMM_EPILOGUES", "silu")
    try:
        gemv_config.set_epilogues(True)
        assert epilogue_config(torch.zeros(rows, 64), weight, 64, "rope") is None
        assert epilogue_config(torch.zeros(rows, 64), weight, 64, "silu") == tuned
        gemv_config.set_epilogues(False)  # KernelSettings.gemm_epilogues
        assert epilogue_config(torch.zeros(rows, 64), weight, 64, "silu") is None
        monkeypatch.setattr(envs, "RAYPAGED_GEMM_EPILOGUES", "0")
        gemv_config.set_epilogues(True)
        assert epilogue_config(torch.zeros(rows, 64), weight, 64, "silu") is None
    finally:
        monkeypatch.undo()
        gemv_config.set_epilogues(True)
    assert gemv_config.allowed_epilogues("rope, silu") == {"rope", "silu"}
    assert gemv_config.allowed_epilogues("") == gemv_config.allowed_epilogues("0") == frozenset()


def test_the_swiglu_epilogue_lets_the_down_projection_launch_at_its_end():
    assert gemv._dependents_at_end(gemv.SILU_MUL)
    assert not gemv._dependents_at_end(gemv.ROPE) and not gemv._dependents_at_end(gemv.PLAIN)


def test_epilogues_refuse_blocks_that_split_a_pair():
    x, weight = torch.zeros(2, 64), torch.zeros(96, 64)
    with pytest.raises(ValueError, match="does not pair the features of heads"):
        gemv_rope(x, weight, None, torch.ones(2, 16), torch.zeros(2, 16), 32, 64,
                  dict(_SMALL, block_n=64))  # half a head is 16 features: 32-wide halves span two
    with pytest.raises(ValueError, match="rope tables must be fp32"):
        gemv_rope(x, weight, None, torch.ones(3, 16), torch.zeros(3, 16), 32, 64, _SMALL)
    with pytest.raises(ValueError, match="does not pair gate and up"):
        gemv_silu_mul(x, weight, None, dict(_SMALL, block_n=64))  # 48 % 32
    with pytest.raises(TypeError, match="unknown config fields"):
        gemv_triton(x, weight, block_m=16)


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


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("rows", [1, 8, MAX_ROWS])
def test_gpu_bf16_epilogues_8b_shapes(rows):
    # the 8B's qkv (32 q and 8 kv heads of 128) and gate/up (14336), with the configs the engine
    # launches them with on this device
    def config(out_features: int, group: int, name: str) -> dict:
        x = torch.zeros(rows, 4096, dtype=torch.bfloat16, device="cuda")
        weight = torch.zeros(out_features, 4096, dtype=torch.bfloat16, device="cuda")
        # below EPILOGUE_MIN_ROWS the engine does not fuse; the kernel must still be right
        return epilogue_config(x, weight, group, name) or default_config(out_features, 4096, 2,
                                                                         rows=rows)

    qkv = config(6144, 64, "rope")
    check_rope_epilogue(rows, 32, 8, 128, torch.bfloat16, False, qkv, "cuda", 4096)
    check_rope_epilogue(rows, 32, 8, 128, torch.bfloat16, True, dict(qkv, split_k=2), "cuda", 4096)
    check_silu_epilogue(rows, 14336, torch.bfloat16, False, config(28672, 14336, "silu"), "cuda", 4096)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("rows", [1, 64])
@pytest.mark.parametrize("split_k", [2, 8])
def test_gpu_bf16_split_k(rows, split_k):
    check(rows, 4096, 14336, torch.bfloat16, device="cuda", block_n=128, block_k=128,
          num_warps=8, num_stages=4, split_k=split_k)
