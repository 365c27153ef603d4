"""End to end through the real loader, scheduler, paged KV cache and sampler: greedy output is
token-identical to transformers' generate (fp32, CPU) for every feature combination, with
asynchronous scheduling off and on (every test runs both ways)."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from raypaged import LLM, SamplingParams
from tests.support.checkpoints import checkpoint_dir
from tests.support.engine_runs import generate_once
from tests.support.hf_oracle import assert_matches_hf, hf_greedy, random_prompts, vocab_of

MAX_TOKENS = 10
GREEDY = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)


def run(name: str, prompts: list[list[int]], params=GREEDY, **engine_kwargs):
    return generate_once(name, prompts, params, **engine_kwargs)


@pytest.mark.parametrize("name", ["llama", "llama3-rope", "llama-tied", "llama-sharded",
                                  "llama-linear-rope", "mistral", "qwen2"])
def test_greedy_matches_transformers_for_each_architecture(name, async_scheduling):
    prompts = random_prompts([1, 7, 17, 40], vocab_of(name), seed=1)
    _, results = run(name, prompts, async_scheduling=async_scheduling)
    assert_matches_hf(name, prompts, results, max_tokens=MAX_TOKENS)


@pytest.mark.parametrize("block_size", [8, 16, 32])
def test_block_sizes(block_size, async_scheduling):
    prompts = random_prompts([3, 16, 33, 50], vocab_of("llama"), seed=2)
    _, results = run("llama", prompts, block_size=block_size, async_scheduling=async_scheduling)
    assert_matches_hf("llama", prompts, results, max_tokens=MAX_TOKENS)


@pytest.mark.parametrize("prefix_caching", [True, False])
def test_shared_prefixes_with_and_without_prefix_caching(prefix_caching, async_scheduling):
    vocab = vocab_of("qwen2")
    prefix = random_prompts([37], vocab, seed=3)[0]
    prompts = random_prompts([1, 5, 20], vocab, seed=4, prefix=prefix)
    llm = LLM(str(checkpoint_dir("qwen2")), block_size=8, enable_prefix_caching=prefix_caching,
              async_scheduling=async_scheduling)
    try:
        first = llm.generate([{"prompt_token_ids": prompts[0]}], GREEDY)
        rest = llm.generate([{"prompt_token_ids": p} for p in prompts[1:]], GREEDY)
    finally:
        llm.shutdown()
    assert_matches_hf("qwen2", prompts, first + rest, max_tokens=MAX_TOKENS)
    # The shared 37-token prefix is 4 full blocks of 8: the later prompts hit them.
    expected_hits = 32 if prefix_caching else 0
    assert [r.num_cached_tokens for r in rest] == [expected_hits, expected_hits]


def test_chunked_prefill_with_a_small_token_budget(async_scheduling):
    prompts = random_prompts([45, 3, 30], vocab_of("llama"), seed=5)
    _, results = run("llama", prompts, max_num_batched_tokens=16, block_size=8,
                     async_scheduling=async_scheduling)
    assert_matches_hf("llama", prompts, results, max_tokens=MAX_TOKENS)


def test_forced_preemption_on_a_tiny_pool(async_scheduling):
    prompts = random_prompts([20, 25, 30, 12], vocab_of("llama"), seed=6)
    params = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
    # 14 blocks of 8 tokens hold ~2 of these requests at full length: the rest are preempted
    # and recomputed, and must still produce the same tokens.
    llm, results = run("llama", prompts, params, block_size=8, num_gpu_blocks_override=14,
                       async_scheduling=async_scheduling)
    assert llm.engine.scheduler.stats().num_preemptions > 0
    assert_matches_hf("llama", prompts, results, max_tokens=24)


def test_parallel_sampling_each_sample_equals_the_single_greedy_result(async_scheduling):
    prompts = random_prompts([13, 24], vocab_of("llama"), seed=7)  # partial last blocks: CoW
    params = SamplingParams(n=3, temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)
    _, results = run("llama", prompts, params, block_size=8, async_scheduling=async_scheduling)
    for result in results:
        assert [o.index for o in result.outputs] == [0, 1, 2]
    assert_matches_hf("llama", prompts, results, max_tokens=MAX_TOKENS)


def test_samples_of_a_prompt_completed_by_a_short_chunk_beside_decodes(async_scheduling):
    """A step of decodes and an n = 2 prompt's last chunk of 2 tokens has as many samples as
    rows, yet both samples come from the chunk's last row (the runner once took "as many" for
    "each row in order" and gave sample 0 the prompt's second-to-last row)."""
    vocab = vocab_of("llama")
    prefix = random_prompts([20], vocab, seed=31)[0]
    prompts = random_prompts([30, 3, 17], vocab, seed=32, prefix=prefix)
    params = SamplingParams(n=2, temperature=0.0, max_tokens=8, ignore_eos=True)
    _, results = run("llama", prompts, params, block_size=8, max_num_batched_tokens=16,
                     enable_prefix_caching=True, async_scheduling=async_scheduling)
    assert_matches_hf("llama", prompts, results, max_tokens=8)


def test_triton_kernels_end_to_end_under_the_interpreter(async_scheduling):
    prompts = random_prompts([5, 19], vocab_of("llama"), seed=8)
    params = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)
    _, results = run("llama", prompts, params, block_size=8, attention_backend="triton",
                     async_scheduling=async_scheduling)
    assert_matches_hf("llama", prompts, results, max_tokens=4)


def test_triton_decode_work_lists_compose_with_caching_chunking_preemption_and_n(
        async_scheduling, monkeypatch):
    """Decode batches of mixed lengths cut into work items (a long request split, its partials
    merged) while a shared prefix is served from the cache, prompts are chunked, requests are
    preempted and recomputed, and each prompt forks n = 2 samples: every sample is greedy's."""
    from raypaged.kernels import decode_work, paged_decode

    planned: list = []
    plan_work = paged_decode.plan_work

    def recording_plan_work(*args, **kwargs):
        planned.append(plan_work(*args, **kwargs))
        return planned[-1]

    monkeypatch.setattr(paged_decode, "plan_work", recording_plan_work)
    vocab = vocab_of("llama")
    shared = random_prompts([24], vocab, seed=11)[0]
    prompts = [shared + p for p in random_prompts([200, 20, 16], vocab, seed=12)] + [shared[:5]]
    params = SamplingParams(n=2, temperature=0.0, max_tokens=8, ignore_eos=True)
    llm, results = run("llama", prompts, params, block_size=8, attention_backend="triton",
                       enable_prefix_caching=True, max_num_batched_tokens=64,
                       num_gpu_blocks_override=40, async_scheduling=async_scheduling)
    assert llm.engine.scheduler.stats().num_preemptions > 0
    assert sum(r.num_cached_tokens for r in results) > 0
    assert any(int(w[decode_work.MERGES, 0]) >= 0 for w in planned)  # a split sequence merged
    assert_matches_hf("llama", prompts, results, max_tokens=8)


def test_stops_on_eos_and_stop_token_ids(async_scheduling):
    name = "llama"
    prompt = random_prompts([9], vocab_of(name), seed=9)[0]
    expected = hf_greedy(checkpoint_dir(name), tuple(prompt), MAX_TOKENS)
    stop_id = expected[4]
    first = expected.index(stop_id)
    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, stop_token_ids=[stop_id])
    llm = LLM(str(checkpoint_dir(name)), async_scheduling=async_scheduling)
    try:
        [result] = llm.generate({"prompt_token_ids": prompt}, params)
        assert result.outputs[0].token_ids == expected[: first + 1]
        assert (result.outputs[0].finish_reason, result.outputs[0].stop_reason) == ("stop", stop_id)
        # min_tokens keeps the stop token from being sampled until enough tokens exist.
        [held] = llm.generate({"prompt_token_ids": prompt},
                              SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS,
                                             stop_token_ids=[stop_id], min_tokens=first + 2))
        held_ids = held.outputs[0].token_ids
        assert held_ids[:first] == expected[:first] and held_ids[first] != stop_id
        assert len(held_ids) >= first + 2
        # EOS: make the model's EOS the stop token; transformers stops there too.
        llm.engine.eos_token_ids = (stop_id,)
        [eos] = llm.generate({"prompt_token_ids": prompt}, SamplingParams(temperature=0.0,
                                                                          max_tokens=MAX_TOKENS))
        assert eos.outputs[0].token_ids == expected[: first + 1]
        assert eos.outputs[0].finish_reason == "stop"
    finally:
        llm.shutdown()


def test_seeded_sampling_is_reproducible_and_seeds_differ(async_scheduling):
    prompts = random_prompts([6, 11], vocab_of("llama"), seed=10)
    llm = LLM(str(checkpoint_dir("llama")), async_scheduling=async_scheduling)
    try:
        def sample(seed, batch):
            params = SamplingParams(temperature=1.0, max_tokens=8, seed=seed, ignore_eos=True)
            return [r.outputs[0].token_ids for r in
                    llm.generate([{"prompt_token_ids": p} for p in batch], params)]
        alone = sample(123, prompts[:1])[0]
        batched = sample(123, prompts)[0]  # different batch composition, same tokens
        assert alone == batched
        assert sample(124, prompts[:1])[0] != alone
    finally:
        llm.shutdown()


def test_text_prompts_stop_strings_and_logprobs(async_scheduling):
    llm = LLM(str(checkpoint_dir("llama")), async_scheduling=async_scheduling)
    try:
        [plain] = llm.generate("The quick brown fox", SamplingParams(temperature=0.0, max_tokens=12,
                                                                     ignore_eos=True, logprobs=2))
        sample = plain.outputs[0]
        assert plain.prompt_token_ids == llm.tokenizer.encode("The quick brown fox")
        assert sample.text == llm.tokenizer.decode(sample.token_ids, skip_special_tokens=True)
        assert len(sample.logprobs) == len(sample.token_ids)
        for token, logprobs in zip(sample.token_ids, sample.logprobs):
            assert token in logprobs and 2 <= len(logprobs) <= 3
            assert max(logprobs.values()) == logprobs[token]  # greedy picks the most likely
        stop = sample.text[3:6]
        [stopped] = llm.generate("The quick brown fox", SamplingParams(
            temperature=0.0, max_tokens=12, ignore_eos=True, stop=[stop]))
        assert stopped.outputs[0].text == sample.text[: sample.text.index(stop)]
        assert (stopped.outputs[0].finish_reason, stopped.outputs[0].stop_reason) == ("stop", stop)
        assert llm.engine.scheduler.kv_cache_manager.num_free_blocks == llm.engine.num_blocks
    finally:
        llm.shutdown()


@pytest.mark.integration
def test_generate_cli_prints_json(async_scheduling):
    out = subprocess.run(
        [sys.executable, "-m", "raypaged.cli", "generate", "--model", str(checkpoint_dir("llama")),
         "--prompt", "The quick", "--max-tokens", "5", "--ignore-eos", "--json",
         "--async-scheduling" if async_scheduling else "--no-async-scheduling"],
        check=True, capture_output=True, text=True, timeout=300).stdout
    result = json.loads(out.strip().splitlines()[-1])
    [sample] = result["outputs"]
    expected = hf_greedy(checkpoint_dir("llama"), tuple(result["prompt_token_ids"]), 5)
    assert sample["token_ids"] == expected and sample["finish_reason"] == "length"


@pytest.mark.gpu
@pytest.mark.parametrize("enforce_eager", [False, True])
def test_on_cuda_with_and_without_cuda_graphs(enforce_eager, async_scheduling):
    """Triton kernels on the GPU, decode through captured CUDA graphs (padded batch sizes):
    still token-identical to transformers in fp32."""
    prompts = random_prompts([1, 7, 17, 40, 3], vocab_of("llama"), seed=16)
    llm = LLM(str(checkpoint_dir("llama")), device="cuda", dtype="float32", block_size=16,
              max_num_seqs=8, enforce_eager=enforce_eager, async_scheduling=async_scheduling)
    try:
        assert (llm.engine.executor.worker.runner.decode_graphs is None) == enforce_eager
        results = llm.generate([{"prompt_token_ids": p} for p in prompts], GREEDY)
    finally:
        llm.shutdown()
    assert_matches_hf("llama", prompts, results, max_tokens=MAX_TOKENS)


def test_repetition_penalty_matches_transformers(async_scheduling):
    """The runner hands the sampler token histories only for rows with penalties: a penalized
    greedy request beside a plain one still equals transformers' RepetitionPenaltyLogitsProcessor
    (over prompt + output), and the plain one is untouched."""
    prompts = random_prompts([6, 12], vocab_of("llama"), seed=17)
    llm = LLM(str(checkpoint_dir("llama")), async_scheduling=async_scheduling)
    try:
        penalized, plain = llm.generate(
            [{"prompt_token_ids": p} for p in prompts],
            [SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True,
                            repetition_penalty=1.5), GREEDY])
    finally:
        llm.shutdown()
    model = checkpoint_dir("llama")
    assert penalized.outputs[0].token_ids == hf_greedy(model, tuple(prompts[0]), MAX_TOKENS,
                                                       repetition_penalty=1.5)
    assert penalized.outputs[0].token_ids != hf_greedy(model, tuple(prompts[0]), MAX_TOKENS)
    assert plain.outputs[0].token_ids == hf_greedy(model, tuple(prompts[1]), MAX_TOKENS)


def test_async_scheduling_equals_sync_on_mixed_random_requests():
    """Every sampling feature at once, seeded (a seeded row's draw depends only on its seed and
    position), on a pool small enough to preempt and a budget small enough to chunk: the tokens,
    finishes and logprobs are the same with asynchronous scheduling as without. This checks what
    the runner hands the sampler under async (token histories with the previous step's tokens
    filled in, min_tokens counts, seed positions), which greedy tests alone would not see.
    Logprob values may differ in the last bits: a step's batch differs between the two modes,
    and with it the matmuls' summation order."""
    import random

    rng = random.Random(23)
    vocab = vocab_of("llama")
    prompts = random_prompts([rng.randrange(1, 40) for _ in range(10)], vocab, seed=24)
    params = []
    for i in range(len(prompts)):
        params.append(SamplingParams(
            n=rng.choice([1, 1, 2]), max_tokens=rng.randrange(4, 24), min_tokens=rng.randrange(0, 3),
            temperature=rng.choice([0.0, 0.7, 1.0]), top_p=rng.choice([1.0, 0.9]),
            top_k=rng.choice([-1, 20]), min_p=rng.choice([0.0, 0.05]),
            repetition_penalty=rng.choice([1.0, 1.3]), presence_penalty=rng.choice([0.0, 0.5]),
            frequency_penalty=rng.choice([0.0, 0.3]), seed=1000 + i,
            stop_token_ids=tuple(rng.sample(range(vocab), 3)), logprobs=rng.choice([None, 2])))

    def outputs(async_scheduling):
        llm, results = run("llama", prompts, params, block_size=8, num_gpu_blocks_override=20,
                           max_num_batched_tokens=24, async_scheduling=async_scheduling)
        assert llm.engine.scheduler.stats().num_preemptions > 0
        return [o for r in results for o in r.outputs]

    for got, expected in zip(outputs(True), outputs(False), strict=True):
        assert (got.token_ids, got.finish_reason, got.stop_reason) == \
            (expected.token_ids, expected.finish_reason, expected.stop_reason)
        assert (got.logprobs is None) == (expected.logprobs is None)
        for mine, theirs in zip(got.logprobs or [], expected.logprobs or [], strict=True):
            assert mine.keys() == theirs.keys()
            assert all(abs(mine[t] - theirs[t]) < 1e-4 for t in mine)
