"""Qwen3, Phi-3 and the long-context ropes end to end (real loader, scheduler, paged cache,
sampler): greedy output token-identical to transformers' generate (fp32, CPU) while a shared
prefix is served from the cache, prompts are chunked under a small token budget and requests are
preempted and recomputed, with asynchronous scheduling off and on."""

from __future__ import annotations

import pytest

from raypaged import LLM, SamplingParams
from tests.support.checkpoints import CHECKPOINTS, checkpoint_dir
from tests.support.hf_oracle import assert_matches_hf, random_prompts, vocab_of

MAX_TOKENS = 20


def generate(name: str, prompts: list[list[int]], max_tokens: int = MAX_TOKENS, **engine_kwargs):
    engine_kwargs.setdefault("max_model_len", CHECKPOINTS[name].max_model_len)
    llm = LLM(str(checkpoint_dir(name)), **engine_kwargs)
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    try:
        return llm.generate([{"prompt_token_ids": p} for p in prompts], params), llm.engine.scheduler.stats()
    finally:
        llm.shutdown()


def _caching_chunking_preemption(name: str, async_scheduling: bool) -> None:
    vocab = vocab_of(name)
    prefix = random_prompts([24], vocab, seed=21)[0]
    prompts = random_prompts([9, 20, 14, 3], vocab, seed=22, prefix=prefix)
    # 12 blocks of 8 hold about two of these at full length (at most 64 tokens: phi3's 64).
    results, stats = generate(name, prompts, block_size=8, enable_prefix_caching=True,
                              max_num_batched_tokens=16, num_gpu_blocks_override=12,
                              async_scheduling=async_scheduling)
    assert stats.num_preemptions > 0
    assert stats.kv_cache.prefix_cache_hits > 0
    assert_matches_hf(name, prompts, results, max_tokens=MAX_TOKENS)


@pytest.mark.parametrize("async_scheduling", [False, True], ids=["sync", "async"])
@pytest.mark.parametrize("name", ["qwen3", "phi3"])
def test_family_matches_transformers_with_caching_chunking_and_preemption(name, async_scheduling):
    _caching_chunking_preemption(name, async_scheduling)


@pytest.mark.slow
@pytest.mark.parametrize("async_scheduling", [False, True], ids=["sync", "async"])
@pytest.mark.parametrize("name", ["qwen3-tied", "phi3-partial", "qwen2-yarn", "llama-dynamic"])
def test_variant_matches_transformers_with_caching_chunking_and_preemption(name, async_scheduling):
    """Tied embeddings and biases with yarn (qwen3-tied), partial rotary (phi3-partial), yarn,
    dynamic NTK: the model-level parity (tests/model/test_hf_parity.py) runs them by default."""
    _caching_chunking_preemption(name, async_scheduling)


@pytest.mark.parametrize("async_scheduling",
                         [pytest.param(False, marks=pytest.mark.slow), True], ids=["sync", "async"])
def test_phi3_long_factors_past_the_original_context(async_scheduling):
    """Served at max_model_len 256 > original 64: the long factors for every token, as
    transformers uses them for a prompt longer than the original context (chunked and cached)."""
    vocab = vocab_of("phi3")
    prefix = random_prompts([40], vocab, seed=23)[0]
    prompts = random_prompts([30, 45], vocab, seed=24, prefix=prefix)
    results, stats = generate("phi3", prompts, max_tokens=8, max_model_len=256, block_size=8,
                              enable_prefix_caching=True, max_num_batched_tokens=32,
                              async_scheduling=async_scheduling)
    assert all(len(p) > 64 for p in prompts)
    assert_matches_hf("phi3", prompts, results, max_tokens=8)
