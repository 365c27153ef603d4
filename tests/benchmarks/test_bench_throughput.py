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
    memory = result["memory"]["all_steps"]
    if mode == "paged":  # waste is under one block per request
        assert memory["unfilled_slots_per_running_request"] < 16
        assert memory["kv_utilization"] > 0.5
    else:  # every running request holds one whole reservation; three fit in 12 blocks
        assert result["memory"]["peak_running"] == 3
        assert all(s["allocated_slots"] == 64 * s["running"] for s in result["samples"])


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
