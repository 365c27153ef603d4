"""benchmarks/bench_tp.py end to end on the tiny shape over gloo: TP=2's greedy tokens equal
TP=1's, the step's collectives, replayed in the worker group, take a measured share of the step
between 0 and 1, and live steps can be traced on every rank. (Its figures are for the GPU; here,
that the machinery holds.)"""

from __future__ import annotations

import json

import pytest
import ray

from benchmarks import bench_tp

pytestmark = pytest.mark.integration


@pytest.fixture(scope="module", autouse=True)
def ray_instance():
    ray.init(num_cpus=4, include_dashboard=False, log_to_driver=False)
    yield
    ray.shutdown()


def test_first_divergence():
    assert bench_tp.first_divergence([1, 2, 3], [1, 2, 3]) is None
    assert bench_tp.first_divergence([1, 2, 3], [1, 5, 3]) == 1
    assert bench_tp.first_divergence([1, 2], [1, 2, 3]) == 2


def test_tp2_matches_tp1_and_measures_its_collectives(tmp_path):
    code = bench_tp.main(["--tp-sizes", "1,2", "--batch-sizes", "2", "--context", "24",
                          "--decode-steps", "4", "--greedy-tokens", "12", "--throughput-batch", "4",
                          "--prompt-len", "8", "--output-len", "4", "--probe-iters", "5",
                          "--profile-steps", "3",
                          "--require-identical", "--out", str(tmp_path)])
    assert code == 0
    result = json.loads((tmp_path / "tp_tiny_cpu.json").read_text())
    assert (tmp_path / "tp_tiny_cpu.png").stat().st_size > 0
    tp1, tp2 = result["runs"]["1"], result["runs"]["2"]
    assert tp2["greedy"] == tp1["greedy"] and tp2["identical_to_reference"]
    assert [len(tokens) for tokens in tp1["greedy"]] == [12] * 4
    assert "collectives" not in tp1["decode"][0]  # nothing to communicate at TP=1
    row = tp2["decode"][0]
    # tiny: 4 layers x (o_proj, down_proj) + the embedding
    assert row["collectives"]["all_reduces"] == 9
    assert 0 < row["all_reduce_share"] <= row["collectives_share"] < 1
    assert all(w["backend"] == "gloo" and w["NCCL_NVLS_ENABLE"] == "0" for w in tp2["workers"])
    assert tp2["throughput"]["output_tokens"] == 4 * 4
    # Live steps traced on every rank: on CPU no kernels to see, only the plumbing works.
    assert [set(r) for r in row["profiled"]] == [{"nccl_ms", "busy_ms", "top_kernels_ms"}] * 2
