"""Prompt logprobs through LLM: each prompt token's logprob (and top-k) equals log_softmax of
transformers' logits on the prompt (fp32, CPU), with chunked prefill cutting the prompt into
chunks, with and without prefix caching (a request that asks takes no hit), asynchronous
scheduling off and on, n = 2 and preemption."""

from __future__ import annotations

import pytest

from raypaged import LLM, SamplingParams
from tests.support.checkpoints import checkpoint_dir
from tests.support.hf_oracle import assert_matches_hf, hf_prompt_logprobs, random_prompts, vocab_of

NAME = "llama"
TOLERANCE = 1e-4


def assert_prompt_logprobs(prompt: list[int], got, k: int) -> None:
    expected = hf_prompt_logprobs(NAME, tuple(prompt))
    assert got is not None and len(got) == len(prompt) and got[0] is None
    for i, entry in enumerate(got[1:]):
        token = prompt[i + 1]
        assert abs(entry[token] - expected[i, token].item()) < TOLERANCE, (i, token)
        top_ids = expected[i].topk(k).indices.tolist() if k else []
        assert set(entry) == set(top_ids) | {token}
        for t, value in entry.items():
            assert abs(value - expected[i, t].item()) < TOLERANCE


# The default suite runs the two far corners; the other two are in the slow suite.
@pytest.fixture(scope="module", params=[(False, False), pytest.param((True, False), marks=pytest.mark.slow),
                                        pytest.param((False, True), marks=pytest.mark.slow), (True, True)],
                ids=["sync", "async", "sync-prefix-cache", "async-prefix-cache"])
def llm(request):
    async_scheduling, prefix_caching = request.param
    # Chunks of 16 tokens: the longer prompts are scored across several chunks.
    engine = LLM(str(checkpoint_dir(NAME)), async_scheduling=async_scheduling, block_size=8,
                 enable_prefix_caching=prefix_caching, max_num_batched_tokens=16,
                 enable_chunked_prefill=True)
    yield engine
    engine.shutdown()


def test_prompt_logprobs_match_transformers_across_chunks(llm):
    prompts = random_prompts([1, 5, 23, 40], vocab_of(NAME), seed=31)
    params = [SamplingParams(temperature=0.0, max_tokens=3, ignore_eos=True, prompt_logprobs=k)
              for k in (0, 2, 3, 1)]
    results = llm.generate([{"prompt_token_ids": p} for p in prompts], params)
    for prompt, p, result in zip(prompts, params, results):
        assert_prompt_logprobs(prompt, result.prompt_logprobs, p.prompt_logprobs)
    assert_matches_hf(NAME, prompts, results, max_tokens=3)


def test_prompt_logprobs_skip_the_prefix_cache_and_stay_exact(llm):
    vocab = vocab_of(NAME)
    prefix = random_prompts([24], vocab, seed=32)[0]
    first, second = random_prompts([6, 9], vocab, seed=33, prefix=prefix)
    greedy = SamplingParams(temperature=0.0, max_tokens=2, ignore_eos=True)
    llm.generate([{"prompt_token_ids": first}], greedy)  # fills the cache with the prefix
    scored, plain = llm.generate(
        [{"prompt_token_ids": second}, {"prompt_token_ids": second}],
        [SamplingParams(temperature=0.0, max_tokens=2, ignore_eos=True, prompt_logprobs=2), greedy])
    assert scored.num_cached_tokens == 0  # asked for prompt logprobs: no hit taken
    assert plain.prompt_logprobs is None
    if llm.engine.scheduler.kv_cache_manager.enable_prefix_caching:
        assert plain.num_cached_tokens > 0
    assert_prompt_logprobs(second, scored.prompt_logprobs, 2)


def test_prompt_logprobs_with_n_and_preemption(monkeypatch):
    from raypaged.worker import prompt_logprobs

    monkeypatch.setattr(prompt_logprobs, "SCORE_ROWS", 5)  # a chunk's positions scored in slices
    prompts = random_prompts([20, 25, 30, 12], vocab_of(NAME), seed=34)
    params = SamplingParams(n=2, temperature=0.0, max_tokens=20, ignore_eos=True, prompt_logprobs=1)
    engine = LLM(str(checkpoint_dir(NAME)), block_size=8, num_gpu_blocks_override=14,
                 max_num_batched_tokens=16, enable_chunked_prefill=True)
    try:
        results = engine.generate([{"prompt_token_ids": p} for p in prompts], params)
        assert engine.engine.scheduler.stats().num_preemptions > 0
    finally:
        engine.shutdown()
    for prompt, result in zip(prompts, results):
        assert_prompt_logprobs(prompt, result.prompt_logprobs, 1)
    assert_matches_hf(NAME, prompts, results, max_tokens=20)


def test_prompt_logprobs_of_a_constrained_request(llm):
    """A constrained request's step may be sampled a call later (its mask waits under async
    scheduling): its prompt's scores still arrive whole, and the output keeps to the grammar."""
    from raypaged.core.structured_output import StructuredOutput

    prompt = random_prompts([21], vocab_of(NAME), seed=35)[0]
    choices = ("alpha", "beta")
    [result] = llm.generate([{"prompt_token_ids": prompt}], SamplingParams(
        temperature=0.0, max_tokens=12, prompt_logprobs=2, structured_output=StructuredOutput(choice=choices)))
    assert result.outputs[0].text in choices
    assert_prompt_logprobs(prompt, result.prompt_logprobs, 2)
