"""KV-cache groups end to end (Gemma 2, Gemma 3, Mistral with a window): one block table per
group of layers of one attention kind over one pool, the sliding groups giving their blocks back
as requests grow past the window.

Every run poisons each block the manager gave back (tests/support/kv_probe.py) before every
step, so a kernel that reads a dropped block, or a block reused by another request while still
in a window, changes the greedy output, which must stay transformers' (fp32, CPU) with prefix
caching, chunked prefill under the window, preemption, parallel sampling (copy-on-write per
group) and asynchronous scheduling. The pool ends whole, and a request holds less KV than a
full-length table for every layer would.
"""

from __future__ import annotations

import pytest
import torch

from raypaged import LLM, SamplingParams
from raypaged.core.hybrid_kv_cache_manager import HybridKVCacheManager
from tests.support.checkpoints import checkpoint_dir
from tests.support.hf_oracle import assert_matches_hf, random_prompts, vocab_of
from tests.support.kv_probe import FreedBlockProbe

MAX_TOKENS = 12
# Blocks that make composed()'s requests preempt each other: blocks hold one group's layers, and a
# request holds a full-length table per full group, about two blocks per sliding one.
POOLS = {"gemma2": 18, "gemma3": 36, "mistral-window": 6}


def run_probed(name: str, prompts: list[list[int]], params, **engine_kwargs):
    """(results, the probe, the scheduler) of one LLM run with freed blocks poisoned."""
    llm = LLM(str(checkpoint_dir(name)), block_size=8, **engine_kwargs)
    try:
        probe = FreedBlockProbe(llm.engine)
        results = llm.generate([{"prompt_token_ids": p} for p in prompts], params)
        probe.check_pool_whole()
        return results, probe, llm.engine.scheduler
    finally:
        llm.shutdown()


def composed(name: str, async_scheduling: bool) -> None:
    """A shared prefix longer than the window served from the cache, chunks below the window,
    preemption in a tight pool, an n = 2 request, contexts several windows long."""
    vocab = vocab_of(name)
    shared = random_prompts([20], vocab, seed=31)[0]
    prompts = [shared + p for p in random_prompts([9, 4], vocab, seed=32)] + \
        random_prompts([30], vocab, seed=33)
    greedy = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)
    params = [greedy, SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True, n=2),
              greedy]
    results, probe, scheduler = run_probed(
        name, prompts, params, enable_prefix_caching=True, max_num_batched_tokens=6,
        max_num_seqs=4, num_gpu_blocks_override=POOLS[name], async_scheduling=async_scheduling)
    assert isinstance(scheduler.kv_cache_manager, HybridKVCacheManager)
    assert_matches_hf(name, prompts, results, max_tokens=MAX_TOKENS)
    assert len(results[1].outputs) == 2
    assert scheduler.stats().num_preemptions > 0
    assert sum(r.num_cached_tokens for r in results) > 0
    assert probe.poisoned  # blocks went back to the pool mid-run, and were poisoned


def test_gemma2_composes_caching_chunking_preemption_and_forks():
    """The default suite's run: a full group and two sliding ones (the rest: slow)."""
    composed("gemma2", async_scheduling=True)


@pytest.mark.slow
@pytest.mark.parametrize("name", ["gemma2", "gemma3", "mistral-window"])
def test_groups_compose_with_every_feature(name, async_scheduling):
    composed(name, async_scheduling)


@pytest.mark.parametrize("name", [pytest.param("gemma3", marks=pytest.mark.slow), "mistral-window"])
def test_a_request_holds_less_kv_than_full_tables(name):
    """One request 48 tokens long (four windows of 12): the grouped pool's peak bytes against
    the same engine with every layer one full-length table (--no-kv-cache-groups)."""
    prompt = random_prompts([12], vocab_of(name), seed=34)
    params = SamplingParams(temperature=0.0, max_tokens=36, ignore_eos=True)
    grouped, probe, _ = run_probed(name, prompt, params, num_gpu_blocks_override=64)
    full, full_probe, scheduler = run_probed(name, prompt, params, num_gpu_blocks_override=64,
                                             kv_cache_groups=False)
    assert not isinstance(scheduler.kv_cache_manager, HybridKVCacheManager)
    assert grouped[0].outputs[0].token_ids == full[0].outputs[0].token_ids
    assert_matches_hf(name, prompt, grouped, max_tokens=36)
    # gemma3 (5 sliding layers of 6, window 12, blocks of 8): 6 + 5 x 3 layer-blocks, not 6 x 6;
    # mistral-window (every layer sliding, window 8): 2 blocks a layer, not 6.
    assert probe.peak_bytes <= 0.6 * full_probe.peak_bytes


def test_a_block_dropped_while_still_in_the_window_fails(monkeypatch):
    """The probe can fail: a manager that drops each sliding block one block early (still in
    the window) gives wrong output."""
    first_needed = HybridKVCacheManager._first_needed

    def early(self, g, num_computed):
        start = first_needed(self, g, num_computed)
        return start + 1 if self.groups[g].is_sliding and num_computed > self.block_size else start

    monkeypatch.setattr(HybridKVCacheManager, "_first_needed", early)
    name = "mistral-window"
    prompts = random_prompts([10, 3], vocab_of(name), seed=35)
    params = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)
    with pytest.raises((AssertionError, ValueError)):
        results, _, _ = run_probed(name, prompts, params, num_gpu_blocks_override=12,
                                   enable_prefix_caching=False)
        assert_matches_hf(name, prompts, results, max_tokens=16)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("name", ["gemma2", "gemma3", "mistral-window"])
def test_groups_on_cuda_through_cuda_graphs(name):
    """Per-group block tables and slot mappings as the CUDA graphs' static inputs (decode
    graphs, piecewise graphs for mixed steps), fp32: still transformers' tokens, pool whole."""
    prompts = random_prompts([1, 7, 30, 41, 3], vocab_of(name), seed=36)
    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)
    llm = LLM(str(checkpoint_dir(name)), device="cuda", dtype="float32", block_size=16,
              max_num_seqs=8, enable_prefix_caching=True)
    try:
        assert llm.engine.executor.worker.runner.decode_graphs is not None
        assert isinstance(llm.engine.scheduler.kv_cache_manager, HybridKVCacheManager)
        results = llm.generate([{"prompt_token_ids": p} for p in prompts], params)
        kv = llm.engine.scheduler.kv_cache_manager
        assert kv.num_free_blocks == kv.num_blocks
    finally:
        llm.shutdown()
    assert_matches_hf(name, prompts, results, max_tokens=MAX_TOKENS)

