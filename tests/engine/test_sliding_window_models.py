"""Gemma 2, Gemma 3 and Mistral with a sliding window, end to end through the real loader,
scheduler, paged KV cache and sampler: greedy output token-identical to transformers' generate
(fp32, CPU), with prompt + generation several times the window (8 or 12 tokens), and with the
features that move a request's KV around: prefix caching, chunked prefill (chunks smaller and
larger than the window), preemption, asynchronous scheduling on and off.

The default suite runs each model once past the window (asynchronous scheduling, the default);
the feature matrix, both ways, is behind the slow mark.

Reading a key outside a layer's window, or missing one inside it, changes the logits; the tiny
random checkpoints' greedy outputs are checked to vary, so a match is not a constant token.
"""

from __future__ import annotations

import pytest
import torch

from raypaged import LLM, SamplingParams
from tests.support.checkpoints import checkpoint_dir
from tests.support.engine_runs import generate_once
from tests.support.hf_oracle import assert_matches_hf, random_prompts, vocab_of

WINDOWED = ["gemma2", "gemma3", "mistral-window"]
MAX_TOKENS = 24
GREEDY = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)


def run(name: str, prompts: list[list[int]], params=GREEDY, **engine_kwargs):
    return generate_once(name, prompts, params, **engine_kwargs)


def assert_varied(results) -> None:
    """No output is one token repeated, and the batch's use many: a degenerate greedy output
    would match transformers whatever the attention read."""
    outputs = [r.outputs[0].token_ids for r in results]
    assert all(len(set(tokens)) > 1 for tokens in outputs)
    assert len({t for tokens in outputs for t in tokens}) >= 10


@pytest.mark.parametrize("async_scheduling", [
    pytest.param(False, id="sync", marks=pytest.mark.slow), pytest.param(True, id="async")])
@pytest.mark.parametrize("name", WINDOWED)
def test_contexts_several_windows_long_match_transformers(name, async_scheduling):
    # Up to 41 + 24 tokens: over five windows of 12, eight of 8.
    prompts = random_prompts([2, 9, 30, 41], vocab_of(name), seed=21)
    _, results = run(name, prompts, block_size=8, async_scheduling=async_scheduling)
    assert_matches_hf(name, prompts, results, max_tokens=MAX_TOKENS)
    assert_varied(results)


@pytest.mark.slow  # tests/engine/test_kv_cache_groups.py runs its like in the default suite
def test_window_composes_with_caching_chunking_preemption():
    """One run with all of them on Gemma 2 (local and global layers, soft caps): a shared prefix
    served from the cache, prompts chunked below the window, requests preempted and recomputed."""
    name = "gemma2"
    vocab = vocab_of(name)
    shared = random_prompts([17], vocab, seed=27)[0]
    prompts = [shared + p for p in random_prompts([9, 4], vocab, seed=28)]
    params = SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True)
    llm, results = run(name, prompts, params, block_size=8, enable_prefix_caching=True,
                       max_num_batched_tokens=6, max_num_seqs=4, num_gpu_blocks_override=14)
    assert llm.engine.scheduler.stats().num_preemptions > 0
    assert sum(r.num_cached_tokens for r in results) > 0
    assert_matches_hf(name, prompts, results, max_tokens=20)


@pytest.mark.slow
@pytest.mark.parametrize("name", ["gemma2", "mistral-window"])
def test_prefix_caching_across_the_window(name, async_scheduling):
    """A 28-token shared prefix (3 full blocks of 8 reused) is longer than the window: the later
    requests' first new tokens attend to cached blocks at the window's edge."""
    vocab = vocab_of(name)
    prefix = random_prompts([28], vocab, seed=22)[0]
    prompts = random_prompts([3, 11], vocab, seed=23, prefix=prefix)
    llm = LLM(str(checkpoint_dir(name)), block_size=8, enable_prefix_caching=True,
              async_scheduling=async_scheduling)
    try:
        first = llm.generate([{"prompt_token_ids": prompts[0]}], GREEDY)
        rest = llm.generate([{"prompt_token_ids": prompts[1]}], GREEDY)
    finally:
        llm.shutdown()
    assert rest[0].num_cached_tokens == 24
    assert_matches_hf(name, prompts, first + rest, max_tokens=MAX_TOKENS)


@pytest.mark.slow
@pytest.mark.parametrize("budget", [5, 20], ids=["chunk<window", "chunk>window"])
@pytest.mark.parametrize("name", ["gemma3", "mistral-window"])
def test_chunked_prefill_chunks_smaller_and_larger_than_the_window(name, budget, async_scheduling):
    prompts = random_prompts([37, 4, 26], vocab_of(name), seed=24)
    _, results = run(name, prompts, max_num_batched_tokens=budget, max_num_seqs=4, block_size=8,
                     async_scheduling=async_scheduling)
    assert_matches_hf(name, prompts, results, max_tokens=MAX_TOKENS)


@pytest.mark.slow
@pytest.mark.parametrize("name", ["gemma2", "gemma3"])
def test_preemption_recomputes_past_the_window(name, async_scheduling):
    prompts = random_prompts([20, 25, 30, 12], vocab_of(name), seed=25)
    # A block holds one KV-cache group's layers (gemma2: 3 groups of 1, gemma3: 6 of 1), and a
    # sliding group only its window: chunks of 8 let the requests run together and outgrow
    # pools this small (each still holds one 54-token request).
    llm, results = run(name, prompts, block_size=8, max_num_batched_tokens=8,
                       num_gpu_blocks_override={"gemma2": 14, "gemma3": 28}[name],
                       async_scheduling=async_scheduling)
    assert llm.engine.scheduler.stats().num_preemptions > 0
    assert_matches_hf(name, prompts, results, max_tokens=MAX_TOKENS)


@pytest.mark.slow
@pytest.mark.parametrize("name", ["gemma2", "mistral-window"])
def test_window_and_softcap_kernels_end_to_end_under_the_interpreter(name):
    """The Triton path: window work lists in decode (one per window, shared by its layers),
    windowed prefill, soft caps in both kernels."""
    prompts = random_prompts([5, 27], vocab_of(name), seed=26)
    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    _, results = run(name, prompts, params, block_size=8, attention_backend="triton",
                     max_num_batched_tokens=16)
    assert_matches_hf(name, prompts, results, max_tokens=12)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("enforce_eager", [False, True], ids=["graphs", "eager"])
@pytest.mark.parametrize("name", WINDOWED)
def test_on_cuda_with_and_without_cuda_graphs(name, enforce_eager, async_scheduling):
    """The window and soft-cap kernels on the GPU, decode through captured CUDA graphs (window
    work lists planned inside them), mixed steps through the piecewise graphs (Gemma 3's two
    ropes in one buffer): still token-identical to transformers in fp32."""
    prompts = random_prompts([1, 7, 30, 41, 3], vocab_of(name), seed=29)
    llm = LLM(str(checkpoint_dir(name)), device="cuda", dtype="float32", block_size=16,
              max_num_seqs=8, enforce_eager=enforce_eager, async_scheduling=async_scheduling)
    try:
        assert (llm.engine.executor.worker.runner.decode_graphs is None) == enforce_eager
        results = llm.generate([{"prompt_token_ids": p} for p in prompts], GREEDY)
    finally:
        llm.shutdown()
    assert_matches_hf(name, prompts, results, max_tokens=MAX_TOKENS)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("variant", ["torch-ops", "no-epilogues"])
def test_gemma2_on_cuda_by_parts(variant):
    """Gemma 2 on CUDA (eager, fp32) with every op on torch, or with the Triton ops but no GEMM
    epilogues: each of the GPU's paths matches transformers, not only the default one."""
    from raypaged.kernels import ops

    prompts = random_prompts([1, 7, 30, 41, 3], vocab_of("gemma2"), seed=29)
    # The worker sets every op's backend from attention_backend.
    llm = LLM(str(checkpoint_dir("gemma2")), device="cuda", dtype="float32", block_size=16,
              max_num_seqs=8, enforce_eager=True, gemm_epilogues=variant != "no-epilogues",
              attention_backend="torch" if variant == "torch-ops" else None)
    try:
        results = llm.generate([{"prompt_token_ids": p} for p in prompts], GREEDY)
    finally:
        llm.shutdown()
        ops.set_backend("auto")
    assert_matches_hf("gemma2", prompts, results, max_tokens=MAX_TOKENS)
