"""The host tier of KV blocks with KV-cache groups (Gemma 2: a full group and two sliding ones,
window 8) through the real loader and the worker's host pool: a shared prefix evicted from a
small GPU pool into the host tier is hit again, and swap preemption sends every group's blocks
to the host and back; greedy tokens stay transformers' (fp32, CPU), with asynchronous scheduling
on and off and prefix caching on, and both pools end whole.

Every run poisons the blocks the manager gave back (tests/support/kv_probe.py), so a load into
the wrong block, or a group reading another group's block, changes the output.
"""

from __future__ import annotations

import json

from raypaged import LLM, SamplingParams
from raypaged.core.tiered_hybrid_kv_cache_manager import TieredHybridKVCacheManager
from tests.support.checkpoints import checkpoint_dir
from tests.support.hf_oracle import assert_matches_hf, random_prompts, vocab_of
from tests.support.kv_probe import FreedBlockProbe

NAME = "gemma2"
BLOCK = 8


def block_bytes() -> int:
    """One block of the fp32 checkpoint: one layer's K and V (its groups are one layer each)."""
    config = json.loads((checkpoint_dir(NAME) / "config.json").read_text())
    return 2 * BLOCK * config["num_key_value_heads"] * config["head_dim"] * 4


def run(prompts_per_turn: list[list[list[int]]], params: SamplingParams, **kwargs):
    """Each turn's prompts generated together, then the next turn's; returns the results per
    turn and the engine's stats and manager."""
    llm = LLM(str(checkpoint_dir(NAME)), block_size=BLOCK, max_model_len=96, skip_tokenizer_init=True,
              enable_prefix_caching=True, **kwargs)
    try:
        probe = FreedBlockProbe(llm.engine)
        results = [llm.generate([{"prompt_token_ids": p} for p in prompts], params)
                   for prompts in prompts_per_turn]
        kv = llm.engine.scheduler.kv_cache_manager
        assert isinstance(kv, TieredHybridKVCacheManager) and kv.num_groups == 3
        probe.check_pool_whole()
        kv.tier.check_pins()
        assert kv.num_swapped_requests == 0 and not any(kv.host_pool.pin_cnt)
        assert probe.poisoned
        # The worker's host pool holds one K/V pair a block: the three layers share one.
        host = llm.engine.executor.worker.runner.host_kv
        assert host is not None and host.blocks[0].numel() * host.blocks.element_size() == block_bytes()
        return results, llm.engine.scheduler.stats()
    finally:
        llm.shutdown()


def test_an_evicted_prefix_comes_back_from_the_host_tier(async_scheduling):
    # A 32-token shared prefix (4 blocks a full group; a hit after it also needs each sliding
    # group's block 3, its window). The turn between evicts it from a 14-block pool.
    vocab = vocab_of(NAME)
    prefix = random_prompts([32], vocab, seed=41)[0]
    turns = [random_prompts([5], vocab, seed=42, prefix=prefix),
             random_prompts([40, 37], vocab, seed=43),
             random_prompts([3, 9], vocab, seed=44, prefix=prefix)]
    params = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
    results, stats = run(turns, params, num_gpu_blocks_override=14, max_num_batched_tokens=8,
                         kv_offload_size=32 * block_bytes() / 2**30, async_scheduling=async_scheduling)
    for prompts, turn in zip(turns, results):
        assert_matches_hf(NAME, prompts, turn, max_tokens=6)
    kv = stats.kv_cache
    assert kv.host_cache_hits >= 32  # the whole prefix, at least once
    assert kv.offloaded_bytes > 0 and kv.loaded_bytes > 0
    assert kv.loaded_bytes % block_bytes() == 0
    assert sum(r.num_cached_tokens for r in results[2]) >= 64


def test_swap_preemption_sends_every_group_to_the_host_and_back(async_scheduling):
    # Four short prompts admitted together (3 blocks each, one a group) that grow to 4 full
    # blocks and two a sliding group each: the 14-block pool preempts.
    prompts = random_prompts([5, 3, 6, 4], vocab_of(NAME), seed=45)
    params = SamplingParams(temperature=0.0, max_tokens=26, ignore_eos=True)
    results, stats = run([prompts], params, num_gpu_blocks_override=14,
                         kv_offload_size=48 * block_bytes() / 2**30, preemption_mode="swap",
                         async_scheduling=async_scheduling)
    assert_matches_hf(NAME, prompts, results[0], max_tokens=26)
    assert stats.num_preemptions > 0
    assert stats.kv_cache.offloaded_bytes > 0  # swapped out
    # (With prefix caching on most resumptions find their blocks still on the GPU; here some do not.)
    assert stats.kv_cache.loaded_bytes > 0 and stats.kv_cache.host_cache_hits > 0
