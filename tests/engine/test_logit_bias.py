"""logit_bias end to end through LLM: greedy output equals transformers' greedy walk over the
biased logits, with asynchronous scheduling off and on, n = 2, chunked prefill and preemption;
unbiased neighbours stay transformers' plain greedy; a grammar still wins over any bias; an id
outside the vocabulary is refused before anything is queued."""

from __future__ import annotations

import functools

import pytest
import torch

from raypaged import LLM, SamplingParams
from raypaged.core.errors import InvalidRequestError
from raypaged.core.structured_output import StructuredOutput
from tests.support.checkpoints import checkpoint_dir
from tests.support.hf_oracle import _hf_model, hf_greedy, random_prompts, vocab_of

NAME = "llama"
MAX_TOKENS = 16


@functools.cache
def hf_biased_greedy(prompt: tuple[int, ...], bias: tuple[tuple[int, float], ...], steps: int) -> list[int]:
    """transformers' greedy generate with the bias as its sequence_bias (single-token sequences
    are exactly logit_bias), EOS off (as ignore_eos)."""
    model = _hf_model(str(checkpoint_dir(NAME)))
    saved = model.generation_config.eos_token_id, model.config.eos_token_id
    model.generation_config.eos_token_id = model.config.eos_token_id = None
    try:
        with torch.inference_mode():
            out = model.generate(torch.tensor([prompt]), max_new_tokens=steps, do_sample=False,
                                 pad_token_id=0, sequence_bias={(t,): b for t, b in bias},
                                 attention_mask=torch.ones(1, len(prompt), dtype=torch.long))
    finally:
        model.generation_config.eos_token_id, model.config.eos_token_id = saved
    return out[0, len(prompt):].tolist()


@pytest.fixture(scope="module", params=[pytest.param(False, marks=pytest.mark.slow), True],
                ids=["sync", "async"])
def async_scheduling(request) -> bool:
    return request.param


def biases_for(prompts: list[list[int]]) -> list[dict[int, float]]:
    """A bias that changes the greedy walk of each prompt: the plain greedy's second token
    pushed down hard, another token lifted a little."""
    result = []
    for prompt in prompts:
        plain = hf_greedy(checkpoint_dir(NAME), tuple(prompt), MAX_TOKENS)
        result.append({plain[1]: -100.0, (plain[0] + 7) % vocab_of(NAME): 0.5})
    return result


def test_biased_greedy_matches_transformers_with_n_and_preemption(async_scheduling):
    prompts = random_prompts([20, 25, 12, 3], vocab_of(NAME), seed=41)
    biases = biases_for(prompts)
    params = [SamplingParams(n=2 if i % 2 else 1, temperature=0.0, max_tokens=MAX_TOKENS,
                             ignore_eos=True, logit_bias=b if i != 3 else None)
              for i, b in enumerate(biases)]
    llm = LLM(str(checkpoint_dir(NAME)), async_scheduling=async_scheduling, block_size=8,
              num_gpu_blocks_override=9, max_num_batched_tokens=16, enable_chunked_prefill=True)
    try:
        results = llm.generate([{"prompt_token_ids": p} for p in prompts], params)
        assert llm.engine.scheduler.stats().num_preemptions > 0
    finally:
        llm.shutdown()
    for i, (prompt, p, result) in enumerate(zip(prompts, params, results)):
        expected = (hf_biased_greedy(tuple(prompt), p.logit_bias_pairs, MAX_TOKENS)
                    if i != 3 else hf_greedy(checkpoint_dir(NAME), tuple(prompt), MAX_TOKENS))
        assert len(result.outputs) == p.n
        for sample in result.outputs:
            assert sample.token_ids == expected, i
        if i != 3:
            assert sample.token_ids != hf_greedy(checkpoint_dir(NAME), tuple(prompt), MAX_TOKENS)


def test_a_grammar_wins_over_the_bias_and_bad_ids_are_refused(async_scheduling):
    llm = LLM(str(checkpoint_dir(NAME)), async_scheduling=async_scheduling)
    try:
        tokenizer = llm.tokenizer
        assert tokenizer is not None
        # Lift every token of "zz" sky-high: the grammar still allows only the choices.
        lifted = {t: 100.0 for t in tokenizer.encode("zz zz")}
        choices = ("alpha", "beta")
        [result] = llm.generate("Pick one:", SamplingParams(
            temperature=0.0, max_tokens=20, logit_bias=lifted,
            structured_output=StructuredOutput(choice=choices)))
        assert result.outputs[0].text in choices
        vocab = vocab_of(NAME)
        with pytest.raises(InvalidRequestError, match="not a token id"):
            llm.generate("x", SamplingParams(logit_bias={vocab: 1.0}))
        assert not llm.engine.scheduler.requests  # nothing queued (a step may still be in flight)
    finally:
        llm.shutdown()


@pytest.mark.gpu
def test_logit_bias_and_prompt_logprobs_on_cuda_with_graphs():
    """On the GPU the sampler (and its bias) and the prompt scoring run after the captured
    graphs: decode steps replay CUDA graphs, mixed steps piecewise ones, and the results are
    still transformers' (fp32)."""
    from tests.support.hf_oracle import hf_prompt_logprobs

    prompts = random_prompts([20, 7, 33], vocab_of(NAME), seed=43)
    biases = biases_for(prompts)
    params = [SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True, logit_bias=biases[0]),
              SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True, prompt_logprobs=2),
              SamplingParams(n=2, temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True, logit_bias=biases[2])]
    llm = LLM(str(checkpoint_dir(NAME)), device="cuda", dtype="float32", block_size=16, max_num_seqs=8,
              max_num_batched_tokens=16, enable_chunked_prefill=True)
    try:
        assert llm.engine.executor.worker.runner.decode_graphs is not None
        results = llm.generate([{"prompt_token_ids": p} for p in prompts], params)
    finally:
        llm.shutdown()
    for i in (0, 2):
        expected = hf_biased_greedy(tuple(prompts[i]), params[i].logit_bias_pairs, MAX_TOKENS)
        assert all(s.token_ids == expected for s in results[i].outputs)
    assert results[1].outputs[0].token_ids == hf_greedy(checkpoint_dir(NAME), tuple(prompts[1]), MAX_TOKENS)
    expected_lp = hf_prompt_logprobs(NAME, tuple(prompts[1]))
    scored = results[1].prompt_logprobs
    assert scored is not None and len(scored) == len(prompts[1])
    for i, entry in enumerate(scored[1:]):
        assert entry is not None
        token = prompts[1][i + 1]
        assert abs(entry[token] - expected_lp[i, token].item()) < 1e-3  # TF32 matmuls on the GPU
