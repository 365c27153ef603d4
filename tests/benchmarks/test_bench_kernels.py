"""The attention-kernel comparison (benchmarks/bench_kernels.py) end to end in its --smoke mode:
tiny cases under the CPU interpreter, FlashInfer absent. Its figures are for the GPU; here, that
every code path runs (uniform and mixed decode, fresh and extending prefill, SDPA where it
applies, the report and the plot) and that an implementation failing its check gets no time."""

from __future__ import annotations

import json

import pytest

from benchmarks import bench_kernels
from benchmarks.lib.attention_cases import SMOKE_DECODE_CASES, SMOKE_PREFILL_CASES

# The run's environment record asks git for the commit and `uname -p` for the processor.
pytestmark = pytest.mark.integration


def run_smoke(tmp_path, *extra: str) -> tuple[int, dict]:
    code = bench_kernels.main(["--smoke", "--out", str(tmp_path), *extra])
    return code, json.loads((tmp_path / "kernels_smoke_cpu.json").read_text())


def test_smoke_runs_every_path_and_checks_before_timing(tmp_path):
    code, result = run_smoke(tmp_path)
    assert code == 0, result["errors"] + result["failed_implementations"]
    assert [r["name"] for r in result["decode"]] == [c.name for c in SMOKE_DECODE_CASES]
    assert [r["name"] for r in result["prefill"]] == [c.name for c in SMOKE_PREFILL_CASES]
    for row in result["decode"] + result["prefill"]:
        ours = row["impls"]["raypaged"]
        assert ours["status"] == "ok" and ours["max_rel_err"] < 0.05 and ours["seconds"] > 0
        for name, impl in row["impls"].items():
            if name.startswith("flashinfer"):
                assert impl["status"] == "absent" and "seconds" not in impl
    uniform, mixed = result["decode"]
    fresh, extend = result["prefill"]
    for row, sdpa in [(uniform, ("sdpa_folded_gqa", "sdpa_enable_gqa")),
                      (fresh, ("sdpa_expanded_kv", "sdpa_enable_gqa"))]:
        assert all(row["impls"][n]["status"] == "ok" for n in sdpa)
        assert row["speedup_vs_sdpa"] > 0 and row["sdpa_best"] in sdpa
    for row in (mixed, extend):
        assert {i["status"] for n, i in row["impls"].items() if n.startswith("sdpa")} == {"n/a"}
        assert row["speedup_vs_sdpa"] is None and row["speedup_vs_flashinfer"] is None
    assert uniform["kind"] == "uniform" and mixed["kind"] == "mixed"
    assert uniform["impls"]["raypaged"]["frac_copy"] > 0 and fresh["impls"]["raypaged"]["TFLOPs"] > 0
    assert set(result["targets_met"]) == {"decode_frac_copy", "mixed_speedup_vs_flashinfer",
                                          "extend_speedup_vs_flashinfer", "fresh_speedup_vs_sdpa"}
    assert result["targets_met"]["mixed_speedup_vs_flashinfer"]["unmeasured"] == [mixed["name"]]
    assert (tmp_path / "kernels_smoke_cpu.png").stat().st_size > 0


def test_a_kernel_that_fails_its_check_is_recorded_without_a_time(tmp_path, monkeypatch):
    def writes_zeros(q, k_cache, v_cache, block_tables, seq_lens, scale, out, **kwargs):
        return out.zero_()

    monkeypatch.setattr(bench_kernels, "paged_decode_triton", writes_zeros)
    name = SMOKE_DECODE_CASES[0].name
    code, result = run_smoke(tmp_path, "--cases", name)
    assert code == 1
    (row,) = result["decode"]
    assert row["impls"]["raypaged"]["status"] == "wrong" and "seconds" not in row["impls"]["raypaged"]
    assert row["speedup_vs_sdpa"] is None
    assert row["impls"]["sdpa_folded_gqa"]["status"] == "ok"  # the peers are still measured
    assert result["failed_implementations"] == [
        {"case": name, "impl": "raypaged", "status": "wrong", "detail": row["impls"]["raypaged"]["detail"]}]


def test_an_unknown_case_is_refused(tmp_path):
    assert bench_kernels.main(["--smoke", "--cases", "no_such_case", "--out", str(tmp_path)]) == 2
