"""Tensor parallelism over Ray actors (gloo on CPU): outputs token-identical to TP=1 and to
transformers, paged features under TP, abort, clean shutdown, a killed worker surfacing as an
error (not a hang) and the group restarting."""

from __future__ import annotations

import os
import signal
import time

import pytest
import ray

from raypaged import LLM, SamplingParams
from raypaged.llm import RequestsFailedError
from tests.support.checkpoints import CHECKPOINTS, checkpoint_dir
from tests.support.hf_oracle import assert_matches_hf, hf_greedy, hf_prompt_logprobs, random_prompts, vocab_of
from tests.support.ray_state import live_actors, live_placement_groups

pytestmark = pytest.mark.integration

GREEDY = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)


@pytest.fixture(scope="module", autouse=True)
def ray_instance():
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
    yield
    ray.shutdown()


def generate(name: str, prompts, tp: int, params=GREEDY, **kwargs):
    llm = LLM(str(checkpoint_dir(name)), tensor_parallel_size=tp, **kwargs)
    try:
        return llm.generate([{"prompt_token_ids": p} for p in prompts], params)
    finally:
        llm.shutdown()


# llama: 4 query / 2 KV heads (TP=4 replicates KV heads); llama3-rope: one KV head (replicated
# at TP=2); qwen2: qkv biases; qwen3: per-head q/k norms, 3 query heads per rank (slow: the
# spawned-rank TP test runs it by default); phi3: fused qkv / gate_up tensors split per rank.
@pytest.mark.parametrize("name,tp", [("llama", 2), ("llama", 4), ("llama3-rope", 2), ("qwen2", 2),
                                     pytest.param("qwen3", 2, marks=pytest.mark.slow), ("phi3", 2)])
def test_tp_greedy_equals_tp1_and_transformers(name, tp):
    prompts = random_prompts([3, 18, 33], vocab_of(name), seed=11)
    max_model_len = CHECKPOINTS[name].max_model_len  # phi3: its short factors, as transformers'
    tp1 = generate(name, prompts, 1, max_model_len=max_model_len)
    tpn = generate(name, prompts, tp, max_model_len=max_model_len)
    assert [r.outputs[0].token_ids for r in tpn] == [r.outputs[0].token_ids for r in tp1]
    assert_matches_hf(name, prompts, tpn, max_tokens=8)


@pytest.mark.parametrize("async_scheduling", [False, True], ids=["sync", "async"])
def test_prefix_caching_chunked_prefill_and_preemption_under_tp2(async_scheduling):
    """Asynchronous scheduling under TP: rank 0 broadcasts its sampled tokens, which the other
    rank's placeholder inputs need; a wrong one there would change every later token."""
    vocab = vocab_of("llama")
    prefix = random_prompts([24], vocab, seed=12)[0]
    prompts = random_prompts([9, 20, 14, 3], vocab, seed=13, prefix=prefix)
    params = SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True)
    llm = LLM(str(checkpoint_dir("llama")), tensor_parallel_size=2, block_size=8,
              max_num_batched_tokens=16, num_gpu_blocks_override=16,
              async_scheduling=async_scheduling)
    try:
        results = llm.generate([{"prompt_token_ids": p} for p in prompts], params)
        stats = llm.engine.scheduler.stats()
    finally:
        llm.shutdown()
    assert stats.num_preemptions > 0
    assert stats.kv_cache.prefix_cache_hits > 0
    assert_matches_hf("llama", prompts, results, max_tokens=20)


@pytest.mark.parametrize("name,async_scheduling", [
    ("gemma3", True), pytest.param("gemma2", False, marks=pytest.mark.slow),
    pytest.param("mistral-window", True, marks=pytest.mark.slow)])
def test_kv_cache_groups_under_tp2(name, async_scheduling):
    """Per-group block tables on both ranks (each lays out its pool from the same groups): a
    prefix longer than the window from the cache, chunks below it, preemption, an n = 2 fork."""
    from raypaged.core.hybrid_kv_cache_manager import HybridKVCacheManager

    vocab = vocab_of(name)
    prefix = random_prompts([20], vocab, seed=16)[0]
    prompts = random_prompts([9, 4], vocab, seed=17, prefix=prefix) + random_prompts([30], vocab, seed=18)
    greedy = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    params = [greedy, SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True, n=2), greedy]
    llm = LLM(str(checkpoint_dir(name)), tensor_parallel_size=2, block_size=8,
              enable_prefix_caching=True, max_num_batched_tokens=6, max_num_seqs=4,
              num_gpu_blocks_override={"gemma3": 36, "gemma2": 18, "mistral-window": 6}[name],
              async_scheduling=async_scheduling)
    try:
        assert isinstance(llm.engine.scheduler.kv_cache_manager, HybridKVCacheManager)
        results = llm.generate([{"prompt_token_ids": p} for p in prompts], params)
        stats = llm.engine.scheduler.stats()
    finally:
        llm.shutdown()
    assert stats.num_preemptions > 0 and stats.kv_cache.prefix_cache_hits > 0
    assert stats.kv_cache.num_used_blocks == 0
    assert_matches_hf(name, prompts, results, max_tokens=12)


def test_swap_preemption_to_the_host_tier_under_tp2():
    """Each rank offloads and loads its own KV heads: a block brought back wrong on either rank
    would change the tokens after it."""
    from tests.support.host_tier import host_gib

    vocab = vocab_of("llama")
    prompts = random_prompts([9, 20, 14, 3], vocab, seed=13, prefix=random_prompts([24], vocab, seed=12)[0])
    params = SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True)
    llm = LLM(str(checkpoint_dir("llama")), tensor_parallel_size=2, block_size=8,
              max_num_batched_tokens=16, num_gpu_blocks_override=16, enable_prefix_caching=False,
              kv_offload_size=host_gib(24, 8), preemption_mode="swap")
    try:
        results = llm.generate([{"prompt_token_ids": p} for p in prompts], params)
        stats = llm.engine.scheduler.stats()
        per_rank = llm.engine.executor.collective_rpc(_host_copy_times)
    finally:
        llm.shutdown()
    assert stats.num_preemptions > 0 and stats.kv_cache.loaded_bytes > 0
    # The copy times are the slowest rank's (on CPU each rank's copies are all exposed).
    kv = stats.kv_cache
    assert kv.host_copy_s == max(t.copy_s for t in per_rank) > 0
    assert kv.host_copy_exposed_s == max(t.exposed_s for t in per_rank) == kv.host_copy_s
    assert_matches_hf("llama", prompts, results, max_tokens=20)


def _host_copy_times(worker):
    """(On each rank) its host tier's copy times so far."""
    return worker.runner.host_kv.copy_times()


def test_structured_outputs_under_tp2_with_async_scheduling_on_a_small_pool():
    """Constrained requests under TP 2, async: rank 0 masks its logits with the deferred masks
    and broadcasts the tokens; outputs equal a sync TP 1 run's, plain neighbours transformers'."""
    from raypaged.core.structured_output import StructuredOutput

    vocab = vocab_of("llama")
    prefix = random_prompts([24], vocab, seed=14)[0]
    prompts = random_prompts([9, 20, 14, 3], vocab, seed=15, prefix=prefix)
    plain = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)
    regex = SamplingParams(temperature=0.0, max_tokens=16,
                           structured_output=StructuredOutput(regex=r"[a-e]{4,30}"))
    choice = SamplingParams(temperature=0.0, max_tokens=16,
                            structured_output=StructuredOutput(choice=("yes", "no", "maybe so")))
    params = [plain, regex, choice, regex]
    common = dict(block_size=8, max_num_batched_tokens=16, num_gpu_blocks_override=16)
    tp2 = generate("llama", prompts, 2, params, async_scheduling=True, **common)
    tp1 = generate("llama", prompts, 1, params, async_scheduling=False, **common)
    assert [r.outputs[0].token_ids for r in tp2] == [r.outputs[0].token_ids for r in tp1]
    assert tp2[2].outputs[0].text in ("yes", "no", "maybe so")
    assert_matches_hf("llama", prompts[:1], tp2[:1], max_tokens=16)


@pytest.mark.parametrize("async_scheduling", [False, True], ids=["sync", "async"])
def test_abort_frees_blocks_and_shutdown_leaves_nothing_behind(async_scheduling):
    from raypaged.core.request import Request

    llm = LLM(str(checkpoint_dir("llama")), tensor_parallel_size=2, block_size=8,
              async_scheduling=async_scheduling)
    engine = llm.engine
    params = SamplingParams(temperature=0.0, max_tokens=50, ignore_eos=True)
    for i, prompt in enumerate(random_prompts([30, 12], vocab_of("llama"), seed=14)):
        engine.add_request(Request(f"r{i}", prompt, params))
    for _ in range(3):
        engine.step()
    assert engine.scheduler.kv_cache_manager.num_free_blocks < engine.num_blocks
    engine.abort_requests(["r0", "r1"])
    engine.step()
    assert engine.scheduler.kv_cache_manager.num_free_blocks == engine.num_blocks
    assert not engine.has_unfinished_requests()
    assert "RayWorkerActor" in live_actors()
    llm.shutdown()
    assert "RayWorkerActor" not in live_actors()
    assert live_placement_groups() == []


@pytest.mark.parametrize("async_scheduling", [False, True], ids=["sync", "async"])
def test_killed_worker_is_detected_and_in_flight_requests_recover(async_scheduling):
    """A rank killed mid-generation: the engine notices within a step, restarts the group and
    recomputes every in-flight request; the outputs equal a fault-free run (asynchronous
    scheduling: the step in flight is dropped with the group and recomputed too)."""
    name = "llama"
    prompts = random_prompts([6, 21, 13], vocab_of(name), seed=15)
    llm = LLM(str(checkpoint_dir(name)), tensor_parallel_size=2, block_size=8,
              async_scheduling=async_scheduling)
    engine = llm.engine
    try:
        from raypaged.core.request import Request

        params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
        for i, prompt in enumerate(prompts):
            engine.add_request(Request(f"k{i}", prompt, params))
        tokens = {f"k{i}": [] for i in range(len(prompts))}
        finished = set()
        for _ in range(4):  # some tokens out, prefix blocks cached, then the fault
            for out in engine.step():
                tokens[out.req_id].extend(out.new_token_ids)
        old_pids = engine.executor.worker_pids()
        os.kill(old_pids[1], signal.SIGKILL)
        start = time.monotonic()
        while len(finished) < len(prompts):
            for out in engine.step():
                assert out.error is None
                tokens[out.req_id].extend(out.new_token_ids)
                if out.finished:
                    finished.add(out.req_id)
        assert time.monotonic() - start < 60
        assert engine.num_worker_restarts == 1
        assert set(engine.executor.worker_pids()).isdisjoint(old_pids)
        for i, prompt in enumerate(prompts):
            assert tokens[f"k{i}"] == hf_greedy(checkpoint_dir(name), tuple(prompt), 12)
        assert engine.scheduler.kv_cache_manager.num_free_blocks == engine.num_blocks
    finally:
        llm.shutdown()
    assert "RayWorkerActor" not in live_actors()


def test_worker_group_that_cannot_come_back_fails_requests_with_an_error():
    from raypaged.core.errors import EngineDeadError

    class NoWorkers:
        def __init__(self, *args):
            raise RuntimeError("no GPUs left")

    llm = LLM(str(checkpoint_dir("llama")), tensor_parallel_size=2, max_worker_restarts=2)
    try:
        os.kill(llm.engine.executor.worker_pids()[0], signal.SIGKILL)
        llm.engine._executor_class = NoWorkers
        with pytest.raises(RequestsFailedError, match="gave up after 2 restarts"):
            llm.generate({"prompt_token_ids": [5, 6, 7]}, GREEDY)
        assert llm.engine.num_worker_restarts == 2
        with pytest.raises(EngineDeadError):
            llm.generate({"prompt_token_ids": [5, 6, 7]}, GREEDY)
    finally:
        llm.shutdown()


def test_group_the_cluster_cannot_place_fails_within_the_placement_timeout():
    """No room for the group (here: bundles bigger than the cluster; after a lost node: no
    capacity left): NoCapacityError after placement_timeout_s, naming what was asked and what is
    free, and its placement group removed (the next attempt must not find the room taken)."""
    from raypaged.executor.errors import NoCapacityError

    groups_before = set(live_placement_groups())
    start = time.monotonic()
    with pytest.raises(NoCapacityError, match=r"2 bundles of \{'CPU': 64.0\}.*within 1 s.*free now"):
        LLM(str(checkpoint_dir("llama")), tensor_parallel_size=2, ray_cpus_per_worker=64.0,
            placement_timeout_s=1)
    assert time.monotonic() - start < 30
    assert set(live_placement_groups()) == groups_before
    assert "RayWorkerActor" not in live_actors()


def test_prompt_logprobs_and_logit_bias_under_tp2():
    """The prompt positions' logits are gathered over the vocabulary shards on every rank (a
    collective both join) and rank 0 scores them; the bias applies in rank 0's sampler, whose
    tokens the other rank's placeholder inputs take (asynchronous scheduling)."""
    prompts = random_prompts([21, 6], vocab_of("llama"), seed=61)
    plain = [hf_greedy(checkpoint_dir("llama"), tuple(p), 6) for p in prompts]
    params = [SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True, prompt_logprobs=2),
              SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True,
                             logit_bias={plain[1][0]: -100.0})]
    llm = LLM(str(checkpoint_dir("llama")), tensor_parallel_size=2, block_size=8,
              max_num_batched_tokens=16, async_scheduling=True)
    try:
        scored, biased = llm.generate([{"prompt_token_ids": p} for p in prompts], params)
    finally:
        llm.shutdown()
    assert scored.outputs[0].token_ids == plain[0]
    assert biased.outputs[0].token_ids[0] != plain[1][0]
    expected = hf_prompt_logprobs("llama", tuple(prompts[0]))
    assert scored.prompt_logprobs is not None and scored.prompt_logprobs[0] is None
    for i, entry in enumerate(scored.prompt_logprobs[1:]):
        assert entry is not None
        token = prompts[0][i + 1]
        assert abs(entry[token] - expected[i, token].item()) < 1e-4
        assert set(entry) == set(expected[i].topk(2).indices.tolist()) | {token}


def test_fp8_kv_cache_under_tp2_equals_tp1():
    """Each rank's FP8 pool holds its KV heads, quantized with the same per-layer scales (read by
    every rank from the checkpoint): TP 2's tokens are TP 1's, with prefix caching, chunking and
    n = 2 forks."""
    from tests.support.kv_scale_checkpoints import kv_scaled_dir

    vocab = vocab_of("llama")
    prompts = random_prompts([9, 20, 3], vocab, seed=41, prefix=random_prompts([16], vocab, seed=40)[0])
    params = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True, n=2)
    outputs = []
    for tp in (1, 2):
        llm = LLM(str(kv_scaled_dir()), tensor_parallel_size=tp, kv_cache_dtype="fp8", block_size=8,
                  enable_prefix_caching=True, max_num_batched_tokens=16)
        try:
            outputs.append([[s.token_ids for s in r.outputs]
                            for r in llm.generate([{"prompt_token_ids": p} for p in prompts], params)])
        finally:
            llm.shutdown()
    assert outputs[0] == outputs[1]
