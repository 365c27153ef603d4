"""The throughput benchmark's own machinery, on a tiny checkpoint: the requests it makes, the
engine run and its memory record, and transformers' static batches. (Its figures are measured on
the GPU; here only that what it counts is right.)"""

from __future__ import annotations

import json

import pytest
import torch

from benchmarks.bench_throughput import run_engine
from benchmarks.lib.hf_static import hf_static_batching
from benchmarks.lib.kv_memory import KVSample, memory_summary
from benchmarks.lib.sharegpt import BenchRequest, sharegpt_requests
from raypaged import LLM
from tests.support.checkpoints import checkpoint_dir
from tests.support.hf_oracle import random_prompts

NAME = "llama"


def vocab() -> int:
    return json.loads((checkpoint_dir(NAME) / "config.json").read_text())["vocab_size"]


def test_requests_fit_the_model_and_max_model_len():
    requests = sharegpt_requests(200, 8192, vocab_size=1000, seed=3)
    assert len(requests) == 200
    assert all(3 <= t < 1000 for r in requests for t in r.prompt_token_ids)
    assert all(len(r.prompt_token_ids) + r.output_len <= 8192 for r in requests)
    # Long-tailed: the longest output is many times the median.
    outputs = sorted(r.output_len for r in requests)
    assert outputs[-1] > 4 * outputs[len(outputs) // 2]
    assert requests == sharegpt_requests(200, 8192, vocab_size=1000, seed=3)  # seeded


def test_memory_summary_ratios():
    samples = [KVSample(0.1, 1, running=2, waiting=1, used_blocks=4, allocated_slots=64,
                        filled_slots=48, shared_saved_slots=0),
               KVSample(0.2, 2, running=1, waiting=0, used_blocks=2, allocated_slots=32,
                        filled_slots=16, shared_saved_slots=16)]
    summary = memory_summary(samples, pool_slots=128, block_size=16)
    overall = summary["all_steps"]
    assert overall["kv_utilization"] == pytest.approx(64 / 96)
    assert overall["pool_usage"] == pytest.approx((4 + 2) * 16 / 256)
    assert overall["pool_token_states"] == pytest.approx(64 / 256)
    assert overall["waste_share_of_pool"] == pytest.approx(32 / 256)
    assert overall["unfilled_slots_per_running_request"] == pytest.approx(32 / 3)
    assert overall["mean_shared_saved_slots"] == 8
    assert summary["while_waiting"]["kv_utilization"] == pytest.approx(48 / 64)
    assert summary["peak_running"] == 2


@pytest.mark.parametrize("mode", ["paged", "contiguous"])
def test_engine_run_counts_every_token_and_records_memory(mode):
    prompts = random_prompts([5, 20, 9, 30, 14, 3], vocab(), seed=1)
    requests = [BenchRequest(p, n) for p, n in zip(prompts, [20, 6, 30, 12, 25, 8])]
    llm = LLM(str(checkpoint_dir(NAME)), kv_cache_mode=mode, max_model_len=64,
              num_gpu_blocks_override=12, skip_tokenizer_init=True)
    try:
        result = run_engine(llm, requests, stats_every=1, device=torch.device("cpu"))
    finally:
        llm.shutdown()
    assert result["output_tokens"] == sum(r.output_len for r in requests)
    assert len(result["samples"]) == result["engine_steps"]
    # The untimed warm-up ran the workload first; its reversed prompts left the timed run no hits.
    assert result["warm_up_seconds"] > 0 and result["prefix_cache_hit_tokens"] == 0
    memory = result["memory"]["all_steps"]
    if mode == "paged":  # waste is under one block per request
        assert memory["unfilled_slots_per_running_request"] < 16
        assert memory["kv_utilization"] > 0.5
    else:  # every running request holds one whole reservation; three fit in 12 blocks
        assert result["memory"]["peak_running"] == 3
        assert all(s["allocated_slots"] == 64 * s["running"] for s in result["samples"])


def test_a_step_window_is_traced_once_and_the_run_is_unchanged():
    from benchmarks.lib.step_profile import StepProfiler

    prompts = random_prompts([5, 20, 9, 30], vocab(), seed=2)
    requests = [BenchRequest(p, n) for p, n in zip(prompts, [20, 6, 30, 12])]
    llm = LLM(str(checkpoint_dir(NAME)), max_model_len=64, num_gpu_blocks_override=12, skip_tokenizer_init=True)
    try:
        profiler = StepProfiler(start=3, count=4, device=torch.device("cpu"))
        traced = run_engine(llm, requests, stats_every=1, device=torch.device("cpu"), profiler=profiler)
        # A window past the run's last step records nothing.
        late = StepProfiler(start=10_000, count=2, device=torch.device("cpu"))
        untraced = run_engine(llm, requests, stats_every=1, device=torch.device("cpu"), profiler=late)
    finally:
        llm.shutdown()
    assert traced["output_tokens"] == untraced["output_tokens"] == sum(r.output_len for r in requests)
    window = traced["step_profile"]
    assert window["steps"] == 4 and window["wall_ms_per_step"] > 0
    assert window["families_ms_per_step"] == {} and window["busy_ms_per_step"] == 0  # no CUDA on CPU
    running, waiting = window["running_waiting_at_start"]
    assert 1 <= running + waiting <= len(requests)
    assert untraced["step_profile"] is None
    with pytest.raises(ValueError, match="start >= 1"):
        StepProfiler(start=0, count=1, device=torch.device("cpu"))


def test_kernel_families_tell_the_fp8_kernels_apart():
    from benchmarks.lib.trace import kernel_family

    assert kernel_family("_w8a8_kernel") == "fused W8A8 GEMM"
    assert kernel_family("_quantize_rows_kernel") == "FP8 activation quantization"
    assert kernel_family("void fbgemm_gpu::f8f8bf16_rowwise_impl<...>") == "FP8 GEMM (scaled_mm)"
    assert kernel_family("_one_row_kernel") == "FP8 skinny GEMM"
    assert kernel_family("_gemv_kernel") == "skinny GEMM"
    assert kernel_family("nvjet_tst_128x256_64x4") == "cuBLAS GEMM"
    assert kernel_family("_prefill_kernel") == kernel_family("_decode_kernel") == "attention"
    assert kernel_family("_merge_kernel") == "attention"
    assert kernel_family("_write_kv_kernel") == "KV write"
    assert kernel_family("elementwise_kernel") == "other"


def test_transformers_static_batches_count_only_asked_tokens():
    prompts = [[5, 6, 7], [8, 9, 10, 11, 12, 13], [14, 15], [16, 17, 18, 19]]
    requests = [BenchRequest(p, n) for p, n in zip(prompts, [3, 9, 2, 5])]
    cpu = torch.device("cpu")
    result = hf_static_batching(checkpoint_dir(NAME), requests, batch_size=2, max_time=None,
                                dtype=torch.float32, device=cpu)
    assert [b["steps_done"] for b in result["batches"]] == [9, 5]  # each batch runs to its longest
    assert [b["prompt_width"] for b in result["batches"]] == [6, 4]
    assert result["output_tokens"] == 3 + 9 + 2 + 5 and not result["truncated"]
    assert result["padding_share_of_rows"] == pytest.approx(1 - 19 / (2 * 9 + 2 * 5))
    cut = hf_static_batching(checkpoint_dir(NAME), requests[:2], batch_size=2, max_time=1e-9,
                             dtype=torch.float32, device=cpu)
    [batch] = cut["batches"]
    assert cut["truncated"] and batch["steps_done"] < 9
    assert batch["output_tokens"] == sum(min(n, batch["steps_done"]) for n in (3, 9))


def test_kv_capacity_counts_the_requests_that_fit_and_runs_them():
    from benchmarks.lib import kv_capacity

    # 4 blocks of 16 tokens hold 2 requests of 32 tokens (2 blocks each, the prompt's already);
    # an FP8 pool of the same memory (bf16 model: 2 bytes a value) holds 8 blocks, 4 requests.
    results = [kv_capacity.measure(checkpoint_dir(NAME), kv, "bfloat16", 32, block_size=16, max_num_seqs=16,
                                   gpu_memory_utilization=0.9, num_kv_blocks=blocks, vocab_size=vocab())
               for kv, blocks in (("auto", 4), ("fp8", 8))]
    bf16, fp8 = results
    assert (bf16["fits"], fp8["fits"]) == (2, 4)
    assert bf16["kv_bytes_per_block_per_rank"] == 2 * fp8["kv_bytes_per_block_per_rank"]
    assert bf16["kv_pool_gib_per_rank"] == fp8["kv_pool_gib_per_rank"]
    # fits + 1 submitted: only `fits` run at once.
    assert (bf16["batch_submitted"], bf16["peak_running"]) == (3, 2)
    assert (fp8["batch_submitted"], fp8["peak_running"]) == (5, 4)


def test_precisions_name_their_engine_settings_and_baseline():
    from benchmarks.lib.precisions import baseline_of, parse_precisions

    fp8, bf16 = parse_precisions("fp8,bf16")
    assert fp8.engine_settings() == {"dtype": "bfloat16", "quantization": "fp8", "kv_cache_dtype": "fp8"}
    assert bf16.engine_settings() == {"dtype": "bfloat16", "quantization": None, "kv_cache_dtype": "auto"}
    assert baseline_of([fp8, bf16]) is bf16  # the first unquantized one, wherever it runs
    assert baseline_of(parse_precisions("fp8-weights,fp8-kv")) is None
    # The same memory: a one-byte pool holds twice a bf16 pool's blocks; fp32's blocks are its own.
    assert (fp8.kv_blocks_in_memory_of(100), bf16.kv_blocks_in_memory_of(100)) == (200, 100)
    assert parse_precisions("fp32")[0].kv_blocks_in_memory_of(100) == 100
    for bad in ("", "bf16,bf16", "int4"):
        with pytest.raises(ValueError):
            parse_precisions(bad)


def test_fixed_requests_are_exactly_their_lengths_and_seeded():
    from benchmarks.lib.fixed_requests import fixed_requests

    requests = fixed_requests(5, 37, 11, vocab_size=50, seed=2)
    assert [(len(r.prompt_token_ids), r.output_len) for r in requests] == [(37, 11)] * 5
    assert all(3 <= t < 50 for r in requests for t in r.prompt_token_ids)
    assert len({tuple(r.prompt_token_ids) for r in requests}) == 5  # random, not one prompt repeated
    assert requests == fixed_requests(5, 37, 11, vocab_size=50, seed=2)


def test_published_figure_on_this_gpu_comes_first():
    from benchmarks.lib.published_peers import published_for

    assert [p.gpu for p in published_for(1000, 1000, "NVIDIA H200")] == ["H200", "H100"]
    assert [p.gpu for p in published_for(1000, 1000, "NVIDIA H100 80GB HBM3")] == ["H100", "H200"]
    assert published_for(1000, 1000, "NVIDIA H200")[0].output_tokens_per_s == 17744
    assert published_for(128, 128, "NVIDIA H200") == []


def run_bench(tmp_path, *argv: str) -> dict:
    from benchmarks.bench_throughput import main

    assert main([*argv, "--out", str(tmp_path), "--name", "test"]) == 0
    [path] = tmp_path.glob("throughput_test_*.json")
    assert path.with_suffix(".png").exists()
    return json.loads(path.read_text())


def assert_runs_measured(result: dict, precisions: list[str], modes: list[str]) -> None:
    """Every engine run counted exactly the tokens the workload asked for, and its tok/s is its
    own tokens over its own seconds."""
    assert list(result["precisions"]) == precisions
    for runs in result["precisions"].values():
        for mode in modes:
            run = runs[mode]
            assert run["output_tokens"] == result["workload"]["output_tokens"]
            assert run["output_tokens_per_s"] == pytest.approx(run["output_tokens"] / run["seconds"])


# The run's environment record asks git for the commit and `uname -p` for the processor.
@pytest.mark.integration
def test_sharegpt_run_at_bf16_and_fp8(tmp_path):
    result = run_bench(tmp_path, "--model", str(checkpoint_dir(NAME)), "--precisions", "bf16,fp8",
                       "--num-requests", "4", "--max-model-len", "128", "--num-kv-blocks", "32",
                       "--hf-requests", "2", "--hf-batch-size", "2")
    assert result["workload"]["name"] == "sharegpt" and result["baseline_precision"] == "bf16"
    assert_runs_measured(result, ["bf16", "fp8"], ["paged", "contiguous"])
    bf16, fp8 = result["precisions"]["bf16"], result["precisions"]["fp8"]
    assert fp8["settings"] == {"dtype": "bfloat16", "quantization": "fp8", "kv_cache_dtype": "fp8"}
    # The same memory: the FP8 pool has twice the blocks; contiguous runs on its paged run's pool.
    assert fp8["paged"]["num_kv_blocks"] == 2 * bf16["paged"]["num_kv_blocks"] == 64
    assert fp8["contiguous"]["num_kv_blocks"] == 64
    for mode in ("paged", "contiguous"):
        assert fp8["over_baseline"][mode] == pytest.approx(
            fp8[mode]["output_tokens_per_s"] / bf16[mode]["output_tokens_per_s"])
    assert "over_baseline" not in bf16
    assert result["target"]["value"] == fp8["over_baseline"]["paged"]
    assert result["target"]["met"] == (result["target"]["value"] >= 1.5)
    hf = result["hf_generate"]
    assert (hf["precision"], hf["dtype"]) == ("bf16", "bfloat16")
    assert bf16["paged_vs_hf"] == pytest.approx(bf16["paged"]["output_tokens_per_s"] / hf["output_tokens_per_s"])
    assert "published_peers" not in result  # nothing is published on this workload


@pytest.mark.integration
def test_fixed_run_records_the_published_peer_beside_its_own_figure(tmp_path):
    from tests.support.checkpoints import roomy_llama

    result = run_bench(tmp_path, "--model", str(roomy_llama(tmp_path / "model")), "--workload", "fixed",
                       "--input-len", "1000", "--output-len", "1000", "--num-requests", "2",
                       "--precisions", "fp8,bf16", "--modes", "paged", "--num-kv-blocks", "256",
                       "--hf-requests", "0")
    workload = result["workload"]
    assert (workload["name"], workload["num_requests"], workload["output_tokens"]) == ("fixed", 2, 2000)
    assert workload["mean_prompt_len"] == 1000 == workload["max_total_len"] - 1000
    assert_runs_measured(result, ["fp8", "bf16"], ["paged"])  # fp8 ran first, bf16 is still the baseline
    fp8, bf16 = result["precisions"]["fp8"], result["precisions"]["bf16"]
    assert fp8["over_baseline"]["paged"] == pytest.approx(
        fp8["paged"]["output_tokens_per_s"] / bf16["paged"]["output_tokens_per_s"])
    assert "target" not in result  # issue 22's 1.5x is the ShareGPT run's
    peers = result["published_peers"]
    assert [(p["engine"], p["precision"], p["output_tokens_per_s"]) for p in peers] == [
        ("TensorRT-LLM", "fp8", 17744.0), ("TensorRT-LLM", "fp8", 15220.0)]
    for peer in peers:
        assert peer["kind"] == "published" and peer["measured_in_this_run"] is False
        assert "perf-overview" in peer["source"] and not peer["same_gpu_as_this_run"]  # a CPU run
        assert peer["raypaged_paged_output_tokens_per_s"] == fp8["paged"]["output_tokens_per_s"]
        assert peer["raypaged_over_published"] == pytest.approx(
            fp8["paged"]["output_tokens_per_s"] / peer["output_tokens_per_s"])
