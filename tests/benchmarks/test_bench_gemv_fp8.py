"""bench_gemv --fp8's planning, without a GPU: the fused W8A8 kernel's sweep grid (what it keeps
and prunes), the table entry it records (chosen only where it beat the engine's path), and that
scripts/gpu.sh's gemv-fp8 suite sweeps every row bucket the kernel may take."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from benchmarks.bench_gemv import weight_shapes
from benchmarks.lib.gemv_fp8 import engine_baseline, w8a8_configs, w8a8_table_entry
from raypaged.kernels import gemm_w8a8

H100_SMS, H100_SMEM = 132, 227 * 1024
GPU_SH = Path(__file__).resolve().parents[2] / "scripts" / "gpu.sh"


def _gemv_fp8_suite() -> str:
    text = GPU_SH.read_text()
    return text[text.index("gemv-fp8) "):text.index(";;", text.index("gemv-fp8) "))]


@pytest.mark.parametrize("rows", [2, 16, 32, 64, 128, 256])
def test_the_sweep_fits_shared_memory_and_splits_only_few_tiles(rows):
    for name, (n, k) in weight_shapes("8b").items():
        configs = w8a8_configs(n, k, rows, H100_SMS, H100_SMEM)
        assert configs, (name, rows)
        assert len({tuple(sorted(c.items())) for c in configs}) == len(configs)
        for c in configs:
            assert set(c) == set(gemm_w8a8.CONFIG_FIELDS)
            stage = c["block_m"] * c["block_k"] * 2 + c["block_k"] * c["block_n"]
            assert c["num_stages"] * stage <= H100_SMEM - 8 * 1024
            assert c["num_stages"] == 4 or 4 * stage > H100_SMEM - 8 * 1024  # 3 only where 4 do not fit
            assert (c["num_warps"] == 8) <= (c["block_m"] * c["block_n"] >= 64 * 128)
            tiles = -(-rows // c["block_m"]) * -(-n // c["block_n"])
            if c["split_k"] > 1:
                assert tiles < H100_SMS and tiles * c["split_k"] <= 2 * H100_SMS
                assert k // c["split_k"] >= 2 * c["block_k"]
        # The few-row buckets try one tile of the rows, and a Hopper warp group's 64.
        block_ms = {c["block_m"] for c in configs}
        assert gemm_w8a8.table_rows(rows) in block_ms or gemm_w8a8.table_rows(rows) > 128


def test_less_shared_memory_prunes_the_large_tiles():
    big = w8a8_configs(4096, 4096, 256, H100_SMS, H100_SMEM)
    small = w8a8_configs(4096, 4096, 256, H100_SMS, 100 * 1024)
    assert len(small) < len(big)
    assert all(c["num_stages"] * (c["block_m"] * c["block_k"] * 2 + c["block_k"] * c["block_n"]) <= 92 * 1024
               for c in small)


def test_a_table_entry_chooses_the_kernel_only_where_it_beat_the_engines_path():
    best = {"config": {"block_m": 64}, "seconds": 10e-6, "rel_error": 0.01}
    assert engine_baseline({"w8a8_scaled_mm": 20e-6, "w8a16": 12e-6}) == ("w8a16", 12e-6)
    entry = w8a8_table_entry("qkv", 6144, 4096, 40, best, ("w8a16", 12e-6))
    assert entry["backend"] == "triton" and entry["rows"] == 64 and entry["dtype"] == gemm_w8a8.TABLE_DTYPE
    assert entry["config"] == best["config"] and entry["engine_path"] == "w8a16"
    assert entry["fused_us"] == pytest.approx(10) and entry["engine_us"] == pytest.approx(12)
    # Within 1% of the engine's path, or slower: the engine's path stays (and replaces a winner).
    assert w8a8_table_entry("qkv", 6144, 4096, 40, best, ("w8a16", 10.05e-6))["backend"] == "engine"
    assert w8a8_table_entry("qkv", 6144, 4096, 40, best, ("w8a8_scaled_mm", 9e-6))["backend"] == "engine"


def test_the_gpu_suite_sweeps_every_row_bucket_the_kernel_takes_within_its_limits():
    suite = _gemv_fp8_suite()
    tune_rows = [int(r) for r in re.search(r"--tune-rows ([\d,]+)", suite).group(1).split(",")]
    buckets = {gemm_w8a8.table_rows(r) for r in range(gemm_w8a8.MIN_ROWS, gemm_w8a8.MAX_ROWS + 1)}
    assert buckets <= {gemm_w8a8.table_rows(r) for r in tune_rows if r >= gemm_w8a8.MIN_ROWS}
    assert int(re.search(r"bench gemv-fp8 (\d+)", suite).group(1)) <= 540
    assert "--table" in suite and 'cp "$table"' in suite
    # The sweep's compiles bound its time: one per distinct config over every shape and bucket.
    shapes = [s for name, s in weight_shapes("8b").items() if name != "lm_head"]
    distinct = {tuple(sorted(c.items())) for r in tune_rows if r >= gemm_w8a8.MIN_ROWS
                for n, k in shapes for c in w8a8_configs(n, k, r, H100_SMS, H100_SMEM)}
    assert len(distinct) <= 60
