"""The skinny GEMM (kernels/gemv.py) against the float64 product.

On CPU it runs under TRITON_INTERPRET=1 (tests/conftest.py) at small shapes; the `gpu` test
repeats it in bf16 at the 8B's shapes with the real compiler (scripts/gpu_kernels.sh). fp32 must
stay within 1e-5 relative of the exact product (IEEE products, fp32 sums); fp16/bf16 within
twice the rounding error F.linear itself makes in that dtype.
"""

from __future__ import annotations

import json

import pytest
import torch
import torch.nn.functional as F

from raypaged.kernels import gemv, gemv_table
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
            for rows in (1, 16, 64):
                config = default_config(4096, 14336, element_size, shared_memory, rows)
                stage = (config["block_n"] + gemv.padded_rows(rows)) * config["block_k"] * element_size
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
    monkeypatch.setattr(gemv, "_tuned", lambda x, w: entries.get(gemv.padded_rows(x.shape[0])))
    assert gemv.launch_config(torch.zeros(gemv.DEFAULT_ROWS, 64), weight) == default_config(
        128, 64, 4, rows=gemv.DEFAULT_ROWS)
    assert gemv.launch_config(torch.zeros(gemv.DEFAULT_ROWS + 1, 64), weight) is None  # cuBLAS
    tuned = {"block_n": 32, "block_k": 32, "num_warps": 4, "num_stages": 2, "split_k": 2}
    entries[64] = {"backend": "triton", "config": tuned}
    entries[16] = {"backend": "cublas", "config": {}}
    assert gemv.launch_config(torch.zeros(40, 64), weight) == tuned
    assert gemv.launch_config(torch.zeros(4, 64), weight) is None
    assert gemv.launch_config(torch.zeros(MAX_ROWS + 1, 64), weight) is None


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
    table = json.loads(path.read_text())
    for entry in table["entries"]:
        assert entry["backend"] in ("triton", "cublas") and entry["rows"] in (16, 32, 64)
        c = entry["config"]
        check(min(entry["rows"], 5), 2 * c["block_n"], 2 * c["block_k"] * c["split_k"], torch.float32,
              **c)


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
@pytest.mark.parametrize("rows", [1, 64])
@pytest.mark.parametrize("split_k", [2, 8])
def test_gpu_bf16_split_k(rows, split_k):
    check(rows, 4096, 14336, torch.bfloat16, device="cuda", block_n=128, block_k=128,
          num_warps=8, num_stages=4, split_k=split_k)
