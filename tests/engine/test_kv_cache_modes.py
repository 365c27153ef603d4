"""kv_cache_mode: the engine on the paged KV cache (default) or on max_model_len contiguous
reservations (the throughput benchmark's baseline). Both must produce transformers' greedy tokens;
they differ only in how many requests fit in the pool at once."""

from __future__ import annotations

import argparse
import json

import pytest

from raypaged import LLM, SamplingParams
from raypaged.config import ConfigError, EngineConfig
from raypaged.core.contiguous_kv_cache_manager import ContiguousKVCacheManager
from raypaged.core.kv_cache_manager import KVCacheManager
from raypaged.core.request import Request
from tests.support.checkpoints import checkpoint_dir
from tests.support.hf_oracle import hf_greedy, random_prompts

NAME = "llama"
MAX_MODEL_LEN = 64  # a reservation: 4 blocks of 16
NUM_BLOCKS = 9  # two reservations fit, with one block no reservation can use
MAX_TOKENS = 12


def vocab() -> int:
    return json.loads((checkpoint_dir(NAME) / "config.json").read_text())["vocab_size"]


def make_llm(mode: str, **kwargs) -> LLM:
    kwargs = {"max_model_len": MAX_MODEL_LEN, "num_gpu_blocks_override": NUM_BLOCKS, **kwargs}
    return LLM(str(checkpoint_dir(NAME)), kv_cache_mode=mode, skip_tokenizer_init=True, **kwargs)


def generate(mode: str, prompts: list[list[int]], params: SamplingParams) -> list[list[list[int]]]:
    llm = make_llm(mode)
    try:
        results = llm.generate([{"prompt_token_ids": p} for p in prompts], params)
    finally:
        llm.shutdown()
    return [[sample.token_ids for sample in r.outputs] for r in results]


def test_greedy_tokens_are_identical_in_both_modes_and_match_transformers():
    # Five requests on a pool of two reservations: the contiguous engine runs them two at a time,
    # reusing freed regions; the paged one runs more at once and preempts as they grow.
    prompts = random_prompts([1, 9, 17, 33, 48], vocab(), seed=11)
    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)
    paged = generate("paged", prompts, params)
    contiguous = generate("contiguous", prompts, params)
    assert contiguous == paged
    for prompt, samples in zip(prompts, paged):
        assert samples == [hf_greedy(checkpoint_dir(NAME), tuple(prompt), MAX_TOKENS)]


def test_parallel_samples_copy_the_parents_reservation():
    # n > 1 forks after the prompt: the contiguous manager copies the parent's blocks into the
    # child's own reservation (a block copy the workers carry out); greedy samples all match.
    prompts = random_prompts([13], vocab(), seed=12)
    params = SamplingParams(n=2, temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)
    [samples] = generate("contiguous", prompts, params)
    expected = hf_greedy(checkpoint_dir(NAME), tuple(prompts[0]), MAX_TOKENS)
    assert samples == [expected, expected]


@pytest.mark.parametrize("mode, manager, running, held_slots",
                         [("paged", KVCacheManager, 4, 4 * 16),
                          ("contiguous", ContiguousKVCacheManager, 2, 2 * MAX_MODEL_LEN)])
def test_contiguous_mode_admits_only_whole_reservations(mode, manager, running, held_slots):
    llm = make_llm(mode)
    try:
        engine = llm.engine
        assert type(engine.scheduler.kv_cache_manager) is manager
        params = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)
        for i, prompt in enumerate(random_prompts([10, 10, 10, 10], vocab(), seed=13)):
            engine.add_request(Request(f"r{i}", prompt, params))
        engine.step()
        stats = engine.scheduler.stats()
        assert (stats.num_running, stats.num_waiting) == (running, 4 - running)
        assert stats.kv_cache.allocated_slots == held_slots
        assert stats.kv_cache.filled_slots == running * 10
        while engine.has_unfinished_requests():
            engine.step()
        assert engine.scheduler.kv_cache_manager.num_free_blocks == NUM_BLOCKS
    finally:
        llm.shutdown()


def test_a_pool_smaller_than_one_reservation_is_refused():
    with pytest.raises(ValueError, match="reservation needs 4 blocks but the pool has only 3"):
        make_llm("contiguous", num_gpu_blocks_override=3)
    make_llm("paged", num_gpu_blocks_override=3).shutdown()  # paged needs no whole reservation


def test_an_unknown_mode_is_rejected_before_anything_starts():
    with pytest.raises(ConfigError, match="kv_cache_mode"):
        EngineConfig(kv_cache_mode="reserved").validate()
    with pytest.raises(ConfigError, match="kv_cache_mode"):
        make_llm("reserved")


def test_command_line_flag():
    parser = argparse.ArgumentParser()
    EngineConfig.add_cli_args(parser)
    assert EngineConfig.from_cli_args(parser.parse_args([])).cache.kv_cache_mode == "paged"
    args = parser.parse_args(["--kv-cache-mode", "contiguous"])
    assert EngineConfig.from_cli_args(args).cache.kv_cache_mode == "contiguous"
    with pytest.raises(SystemExit):
        parser.parse_args(["--kv-cache-mode", "reserved"])
