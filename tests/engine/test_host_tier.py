"""The host tier of KV blocks in the engine (--kv-offload-size, --preemption-mode swap): greedy
tokens identical with the tier on and off, and with swap, recompute or no preemption; blocks that
left the GPU pool come back from the host; both pools whole at the end."""

from __future__ import annotations

import argparse

import pytest
from prometheus_client import generate_latest

from raypaged import LLM, SamplingParams
from raypaged.config import ConfigError, EngineConfig
from raypaged.core.tiered_kv_cache_manager import TieredKVCacheManager
from raypaged.frontend.metrics import FrontendMetrics
from tests.support import host_tier
from tests.support.checkpoints import checkpoint_dir
from tests.support.hf_oracle import assert_matches_hf, random_prompts, vocab_of

NAME = "llama"
BLOCK = 8


def host_gib(num_blocks: int, name: str = NAME) -> float:
    return host_tier.host_gib(num_blocks, BLOCK, name)


def make_llm(num_gpu_blocks: int, num_host_blocks: int = 0, **kwargs) -> LLM:
    if num_host_blocks:
        kwargs["kv_offload_size"] = host_gib(num_host_blocks)
    return LLM(str(checkpoint_dir(NAME)), block_size=BLOCK, max_model_len=96,
               num_gpu_blocks_override=num_gpu_blocks, skip_tokenizer_init=True, **kwargs)


def check_pools_whole(llm: LLM) -> None:
    kv = llm.engine.scheduler.kv_cache_manager
    assert kv.num_free_blocks == kv.num_blocks
    if isinstance(kv, TieredKVCacheManager):
        kv.host_pool.check()
        assert all(pins == 0 for pins in kv.host_pool.pin_cnt) and kv.num_swapped_requests == 0


def run_turns(llm: LLM, turns: list[list[list[int]]], params: SamplingParams) -> list[list[list[int]]]:
    """Each turn's prompts generated together, the turns one after another."""
    out = []
    for prompts in turns:
        results = llm.generate([{"prompt_token_ids": p} for p in prompts], params)
        out.append([[s.token_ids for s in r.outputs] for r in results])
    return out


def test_evicted_prefix_blocks_come_back_from_the_host_tier(async_scheduling):
    # A 32-token shared prefix (4 blocks); the turn between evicts it from a 12-block pool, the
    # last turn finds it in the host tier. Chunked prefill (8 tokens a step) and n = 2 on top.
    vocab = vocab_of(NAME)
    prefix = random_prompts([32], vocab, seed=21)[0]
    turns = [random_prompts([5], vocab, seed=22, prefix=prefix),
             random_prompts([40, 41], vocab, seed=23),
             random_prompts([3, 9], vocab, seed=24, prefix=prefix)]
    params = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True, n=2)
    common = dict(max_num_batched_tokens=8, async_scheduling=async_scheduling)
    plain = make_llm(12, **common)
    try:
        expected = run_turns(plain, turns, params)
    finally:
        plain.shutdown()
    llm = make_llm(12, num_host_blocks=16, **common)
    metrics = FrontendMetrics("m", 96)
    per_turn = []
    try:
        for turn, want in zip(turns, expected):
            assert run_turns(llm, [turn], params) == [want]
            per_turn.append(llm.engine.scheduler.stats().kv_cache)
            metrics.record_engine_stats(llm.engine.scheduler.stats())
        stats = per_turn[-1]
        prefetches = llm.engine.scheduler.kv_cache_manager.num_prefetches
        check_pools_whole(llm)
    finally:
        llm.shutdown()
    assert stats.host_cache_hits >= 32  # the whole prefix, at least once
    assert prefetches > 0  # a request waited a step for its loads (the step did not)
    assert stats.offloaded_bytes > 0 and stats.loaded_bytes > 0
    # The copies' time: on CPU they are synchronous, all of it exposed. The last turn loaded
    # the prefix back, so its total grew; no total ever goes down.
    assert stats.host_copy_s > 0 and stats.host_copy_exposed_s == stats.host_copy_s
    assert stats.host_copy_hidden_s == 0
    copy_totals = [kv.host_copy_s for kv in per_turn]
    assert copy_totals == sorted(copy_totals) and copy_totals[-1] > copy_totals[-2]
    assert all(kv.host_copy_exposed_s == kv.host_copy_s for kv in per_turn)
    text = generate_latest(metrics.registry).decode()
    for kind in ("copy", "exposed"):
        line = f'raypaged_kv_host_copy_seconds_total{{engine="0",kind="{kind}",model_name="m"}} '
        assert float(text.split(line)[1].split()[0]) == pytest.approx(stats.host_copy_s)
    assert_matches_hf(NAME, turns[2], [_Result(samples) for samples in expected[2]], max_tokens=6)


def test_the_copy_times_go_on_over_a_worker_group_restart():
    """A new worker group's totals start at zero; the engine's go on from the old group's."""
    vocab = vocab_of(NAME)
    prefix = random_prompts([32], vocab, seed=31)[0]
    turns = [random_prompts([5], vocab, seed=32, prefix=prefix), random_prompts([40, 41], vocab, seed=33),
             random_prompts([3], vocab, seed=34, prefix=prefix)]
    params = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)
    llm = make_llm(12, num_host_blocks=16)
    try:
        run_turns(llm, turns, params)
        before = llm.engine.scheduler.stats().kv_cache
        llm.engine._recover("a test restarts the worker group")
        assert llm.engine.scheduler.stats().kv_cache.host_copy_s == before.host_copy_s
        run_turns(llm, turns, params)
        after = llm.engine.scheduler.stats().kv_cache
        host_kv = llm.engine.executor.worker.runner.host_kv
        assert host_kv is not None
        new_group = host_kv.copy_times()
    finally:
        llm.shutdown()
    assert before.host_copy_s > 0 and new_group.copy_s > 0
    assert after.host_copy_s == pytest.approx(before.host_copy_s + new_group.copy_s)
    assert after.host_copy_exposed_s == pytest.approx(before.host_copy_exposed_s + new_group.exposed_s)


class _Result:
    """What assert_matches_hf reads of a RequestOutput: its samples' tokens and finish."""

    def __init__(self, samples: list[list[int]]) -> None:
        self.outputs = [argparse.Namespace(token_ids=tokens, finish_reason="length") for tokens in samples]


@pytest.mark.parametrize("async_scheduling, prefix_caching", [
    pytest.param(False, True, id="sync-prefix-caching"),
    pytest.param(True, False, id="async-no-prefix-caching"),
    pytest.param(True, True, id="async-prefix-caching", marks=pytest.mark.slow),
    pytest.param(False, False, id="sync-no-prefix-caching", marks=pytest.mark.slow)])
def test_swap_preemption_gives_the_tokens_of_recompute_and_of_no_preemption(async_scheduling, prefix_caching):
    prompts = random_prompts([17, 20, 12, 23], vocab_of(NAME), seed=25)
    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    common = dict(async_scheduling=async_scheduling, enable_prefix_caching=prefix_caching)
    outputs, stats = {}, {}
    for label, gpu_blocks, kwargs in [("roomy", 40, {}),
                                      ("recompute", 10, {}),
                                      ("swap", 10, dict(num_host_blocks=24, preemption_mode="swap"))]:
        llm = make_llm(gpu_blocks, **common, **kwargs)
        try:
            outputs[label] = run_turns(llm, [prompts], params)
            stats[label] = llm.engine.scheduler.stats()
            check_pools_whole(llm)
        finally:
            llm.shutdown()
    assert outputs["swap"] == outputs["recompute"] == outputs["roomy"]
    assert stats["roomy"].num_preemptions == 0
    assert stats["recompute"].num_preemptions > 0 and stats["swap"].num_preemptions > 0
    swapped = stats["swap"].kv_cache
    assert swapped.offloaded_bytes > 0  # swapped out
    if not prefix_caching:  # (with it, a resumed request may find its blocks still on the GPU)
        assert swapped.loaded_bytes > 0 and swapped.host_cache_hits > 0  # back from the host


def test_settings_and_flags():
    from raypaged.config.cli import add_cli_args, settings_from_cli_args

    parser = argparse.ArgumentParser()
    add_cli_args(parser)
    settings = settings_from_cli_args(parser.parse_args(["--kv-offload-size", "4", "--preemption-mode", "swap"]))
    assert (settings["kv_offload_size"], settings["preemption_mode"]) == (4.0, "swap")
    assert settings_from_cli_args(parser.parse_args(["--cpu-offload-gb", "2.5"]))["kv_offload_size"] == 2.5
    assert EngineConfig().cache.kv_offload_size == 0.0 and EngineConfig().cache.preemption_mode == "recompute"
    for bad in [dict(preemption_mode="swap"), dict(kv_offload_size=-1.0),
                dict(kv_offload_size=1.0, kv_cache_mode="contiguous"), dict(preemption_mode="move")]:
        with pytest.raises(ConfigError):
            EngineConfig(**bad).validate()


def test_a_host_tier_too_small_for_one_block_is_a_config_error():
    with pytest.raises(ConfigError, match="holds no KV block"):
        make_llm(8, kv_offload_size=host_gib(1) / 2)


def test_the_host_tier_metrics_count_what_the_stats_add():
    from prometheus_client import generate_latest

    from raypaged.core.kv_cache_interface import KVCacheStats
    from raypaged.core.scheduler import SchedulerStats
    from raypaged.frontend.metrics import FrontendMetrics

    metrics = FrontendMetrics("m", 64)

    def record(hits: int, offloaded: int, loaded: int, copy_s: float, exposed_s: float) -> None:
        kv = KVCacheStats(8, 8, BLOCK, 0, 0, 0, 0, 0, hits, host_cache_hits=hits, num_host_blocks=4,
                          num_host_free_blocks=3, offloaded_bytes=offloaded, loaded_bytes=loaded,
                          host_copy_s=copy_s, host_copy_exposed_s=exposed_s)
        metrics.record_engine_stats(SchedulerStats(0, 0, 0, kv))

    record(16, 4096, 0, 0.25, 0.125)
    record(24, 8192, 2048, 0.75, 0.25)
    text = generate_latest(metrics.registry).decode()
    for line in ['raypaged_host_cache_hits_total{engine="0",model_name="m"} 24.0',
                 'raypaged_kv_offloaded_bytes_total{engine="0",model_name="m"} 8192.0',
                 'raypaged_kv_loaded_bytes_total{engine="0",model_name="m"} 2048.0',
                 'raypaged_kv_host_free_blocks{engine="0",model_name="m"} 3.0',
                 'raypaged_kv_host_copy_seconds_total{engine="0",kind="copy",model_name="m"} 0.75',
                 'raypaged_kv_host_copy_seconds_total{engine="0",kind="exposed",model_name="m"} 0.25']:
        assert line in text
