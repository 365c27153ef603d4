"""FP8 weights end to end (LLM → engine → worker → loader): greedy output is what transformers
generates on the same quantization (compressed-tensors' FP8_DYNAMIC of the same checkpoint, its
fake-quantized forward), with the engine's features on: async and sync scheduling, prefix
caching across calls, chunked prefill under a small token budget, n > 1."""

from __future__ import annotations

import pytest

from raypaged import LLM, SamplingParams
from tests.support.checkpoints import checkpoint_dir
from tests.support.fp8_checkpoints import compressed_tensors_dir
from tests.support.hf_oracle import hf_greedy, random_prompts, vocab_of

MAX_TOKENS = 8


# Each scheduling mode once (the float tests run every feature both ways): an engine start is
# ~10 s on CI's cores.
@pytest.mark.parametrize("source, async_scheduling", [("at-load", True), ("compressed-tensors", False)])
def test_fp8_greedy_matches_transformers_with_prefix_caching_chunking_and_n(source, async_scheduling):
    oracle = compressed_tensors_dir("channel", "token")
    if source == "at-load":
        llm = LLM(str(checkpoint_dir("llama")), quantization="fp8", block_size=8, enable_prefix_caching=True,
                  max_num_batched_tokens=24, async_scheduling=async_scheduling)
    else:
        llm = LLM(str(oracle), block_size=8, enable_prefix_caching=True, max_num_batched_tokens=24,
                  async_scheduling=async_scheduling)
    vocab = vocab_of("llama")
    prefix = random_prompts([19], vocab, seed=5)[0]
    prompts = random_prompts([1, 6, 30], vocab, seed=6, prefix=prefix)
    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True, n=2)
    try:
        first = llm.generate([{"prompt_token_ids": prompts[0]}], params)
        rest = llm.generate([{"prompt_token_ids": p} for p in prompts[1:]], params)
    finally:
        llm.shutdown()
    for prompt, result in zip(prompts, first + rest):
        expected = hf_greedy(oracle, tuple(prompt), MAX_TOKENS)
        assert [s.token_ids for s in result.outputs] == [expected, expected]
